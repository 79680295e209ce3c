"""The default root filesystem of a sandbox: what of the host is visible, read-only.

``default.json`` lists the host paths bound read-only and the host /etc entries
kept; ``etc/`` holds the files generated for every sandbox (passwd, group, hosts...).
karotte/mounts.py turns this description into a mount plan.
"""
