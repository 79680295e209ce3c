"""Q3Revenue: a data question with one exact answer.

/workspace/orders.csv holds a year of orders; the agent writes the third quarter's paid
revenue, in cents, to /workspace/answer.txt. The data come from the seed, with orders on
the quarter's boundary days (June 30, July 1, September 30, October 1), refunded,
cancelled and pending orders, and customer names that hold commas inside quotes. The
expected total is computed when the hidden files are made and exists only in the
grader's /hidden: it is never in the workspace.

The hidden total is a function of the visible orders, so it tells nothing that reading
them would not. The year and the orders are drawn from streams of the seed (seeded with
strings that name them); neither the seed nor a number computed from it is ever shown:
the seed is the root of every stream (docs/examples.md, "Generators that stay safe").
"""
from __future__ import annotations

import csv
import datetime
import io
import random
import re

from karotte.environment import Environment, Grade
from karotte.grader_runtime import GraderError
from karotte.spec import MiB, SandboxSpec

STATUSES = (("paid", 70), ("refunded", 12), ("cancelled", 10), ("pending", 8))
FIRST = ("Ada", "Bruno", "Chen", "Dana", "Emeka", "Fatima", "Goran", "Hana", "Ines", "Jonas",
         "Kofi", "Lena", "Mateo", "Nora", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tariq")
LAST = ("Okafor", "Lindqvist", "Moreau", "Tanaka", "Novak", "O'Brien", "Schmidt", "Haddad",
        "Kowalski", "Ferreira", "Ivanova", "Nakamura")
COMPANIES = ("Acme, Inc.", "Blue Harbor Ltd", "Cedar & Pine", "Delta Foods, LLC",
             "Eastwind Co.", "Fjord Analytics", 'The "Good" Bakery', "Granite Works")
BOUNDARY_DAYS = ((6, 30), (7, 1), (9, 30), (10, 1))
# The whole answer: a plain decimal integer, whitespace around it ignored. No sign, no
# point, no exponent, no NaN; ASCII digits only (int() alone would take "1_000" or "١٢").
INTEGER = re.compile(rb"\s*([0-9]+)\s*")
ANSWER_LIMIT = 64


def year_of(seed: int) -> int:
    """The year of the orders: a draw of its own stream, not the seed's remainder (which
    would show a part of the seed in the prompt)."""
    return random.Random(f"q3_revenue:year:{seed}").randrange(2018, 2025)


def is_q3_paid(row: dict, year: int) -> bool:
    return row["status"] == "paid" and f"{year}-07-01" <= row["date"] <= f"{year}-09-30"


def orders(seed: int) -> list[dict]:
    """The orders of one year, sorted by date; a few hundred to a few thousand rows."""
    rng = random.Random(f"q3_revenue:{seed}")
    year = year_of(seed)
    names, weights = zip(*STATUSES)
    first_day = datetime.date(year, 1, 1)
    days = (datetime.date(year, 12, 31) - first_day).days + 1
    dated = [(first_day + datetime.timedelta(days=rng.randrange(days)),
              rng.choices(names, weights)[0]) for _ in range(rng.randint(300, 2500))]
    # Every boundary day has orders of every status, so an off-by-one day or a wrong
    # status filter always changes the total.
    for month, day in BOUNDARY_DAYS:
        dated += [(datetime.date(year, month, day), status)
                  for status in names + tuple(rng.choices(names, weights, k=3))]
    rng.shuffle(dated)
    dated.sort(key=lambda d: d[0])
    rows = []
    for i, (date, status) in enumerate(dated):
        if rng.random() < 0.25:
            customer = rng.choice(COMPANIES)
        elif rng.random() < 0.3:
            customer = f"{rng.choice(LAST)}, {rng.choice(FIRST)}"
        else:
            customer = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
        rows.append({"order_id": str(100000 + 7 * i + rng.randrange(7)),
                     "date": date.isoformat(), "customer": customer,
                     "quantity": str(rng.choice((1, 1, 1, 2, 2, 3, 4, 5, 10, 12, 24))),
                     "unit_price": str(rng.randint(99, 25000)), "status": status})
    return rows


def to_csv(rows: list[dict]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=("order_id", "date", "customer", "quantity",
                                             "unit_price", "status"), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def revenue(rows: list[dict], year: int) -> int:
    return sum(int(r["quantity"]) * int(r["unit_price"]) for r in rows if is_q3_paid(r, year))


class Q3Revenue(Environment):
    """Third-quarter paid revenue from a CSV of orders; reward 1 for the exact integer."""

    deliverables = ("answer.txt",)
    limits = SandboxSpec(memory=512 * MiB, timeout=60)
    reward_range = (0.0, 1.0)

    def prompt(self, seed: int) -> str:
        year = year_of(seed)
        return (
            f"/workspace/orders.csv holds the orders of a shop in {year}: a CSV file with a "
            "header row and the columns order_id, date (YYYY-MM-DD), customer, quantity, "
            "unit_price (in cents) and status (paid, refunded, cancelled or pending). Fields "
            "that contain commas or quotes are quoted as usual in CSV.\n\n"
            f"Compute the revenue of the third quarter of {year}: the sum of quantity * "
            "unit_price over the orders whose status is exactly `paid` and whose date is "
            f"from {year}-07-01 to {year}-09-30, both days included. Write it, in cents, as "
            "a plain decimal integer (ASCII digits only: no sign, no decimal point, no "
            "thousands separators) to /workspace/answer.txt. Whitespace around the number, "
            "such as a trailing newline, is ignored.\n\n"
            "How you are graded: after you finish, a grader reads /workspace/answer.txt and "
            "gives reward 1 if it holds exactly the right integer, and 0 otherwise (also 0 if "
            "the file is missing, is not a regular file, or holds anything else). Nothing "
            "else in /workspace is looked at. The machine has no network; python3 (standard "
            "library only), awk and the usual shell tools are there.\n\n"
            "If you find that you cannot do the task, you may give up with the give_up tool; "
            "that ends the episode with reward 0.")

    def workspace_files(self, seed: int):
        return {"orders.csv": to_csv(orders(seed))}

    def hidden_files(self, seed: int):
        return {"expected.txt": f"{revenue(orders(seed), year_of(seed))}\n"}

    def grade(self, ctx) -> Grade:
        expected = int((ctx.hidden / "expected.txt").read_text())
        try:
            answer = ctx.read_deliverable("answer.txt", limit=ANSWER_LIMIT)
        except GraderError:
            return Grade(0.0, {"why": f"answer.txt is larger than {ANSWER_LIMIT} bytes"})
        if answer is None:
            return Grade(0.0, {"why": "no answer.txt"})
        match = INTEGER.fullmatch(answer)
        if match is None:
            return Grade(0.0, {"why": "answer.txt does not hold a plain decimal integer"})
        if int(match.group(1)) != expected:
            return Grade(0.0, {"why": "wrong total"})
        return Grade(1.0, {"why": "right total"})

    def reference_solution(self, seed: int):
        return ["python3 -c \"import csv; print(sum(int(r['quantity']) * int(r['unit_price']) "
                "for r in csv.DictReader(open('orders.csv')) if r['status'] == 'paid' "
                "and r['date'][5:7] in ('07', '08', '09')))\" > answer.txt"]
