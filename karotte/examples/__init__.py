"""Example environments, each with a reference solution (docs/examples.md):

- q3_revenue.Q3Revenue: one exact integer from a CSV of orders; reward 0 or 1.
- speedup.Speedup: make a quadratic program fast; reward = the measured speedup.
- fix_tests.FixTests: fix a buggy package; reward = fraction of hidden cases passed.
- fix_tests_pytest.FixTestsPytest: FixTests on a Debian image, its hidden cases run by pytest.

Run one with `Episode("karotte.examples.q3_revenue:Q3Revenue", seed=1)`.
"""
