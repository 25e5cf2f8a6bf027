"""The two workloads of ``afm bench --speculation``: chat and code editing.

``chat``: questions answered in prose (little of the answer is in the
prompt: what a draft model is for, and where prompt lookup finds little).
``code_edit``: the model is given a Python file and asked to rewrite it with
one identifier renamed, in full (most of the answer repeats the prompt: what
prompt lookup is for).  Fixed texts, so every run and every target sends the
same requests; job ``i`` is prompt ``i`` modulo the list.
"""

from __future__ import annotations

from ._workload import Job, Workload

__all__ = ["CHAT", "CODE_EDIT", "workloads"]

CHAT: tuple[str, ...] = (
    "Write a short essay about why lighthouses were important for sailors.",
    "Explain how a hash table works to a new programmer, with a small example.",
    "Give practical advice to someone starting a vegetable garden on a small balcony.",
    "Describe the water cycle and why it matters for farming.",
)

_PRICES = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        price = item["price"] * item["quantity"]
        if item.get("discount"):
            price = price - price * item["discount"]
        subtotal = subtotal + price
    tax = subtotal * tax_rate
    return round(subtotal + tax, 2)


def cheapest(items):
    best = None
    for item in items:
        if best is None or item["price"] < best["price"]:
            best = item
    return best


def by_category(items):
    groups = {}
    for item in items:
        groups.setdefault(item["category"], []).append(item)
    return groups
'''

_INVENTORY = '''class Inventory:
    """Items in stock, by name."""

    def __init__(self):
        self.stock = {}

    def add(self, name, count=1):
        if count <= 0:
            raise ValueError("count must be positive")
        self.stock[name] = self.stock.get(name, 0) + count

    def remove(self, name, count=1):
        have = self.stock.get(name, 0)
        if count > have:
            raise KeyError(f"only {have} of {name} in stock")
        self.stock[name] = have - count
        if self.stock[name] == 0:
            del self.stock[name]

    def count(self, name):
        return self.stock.get(name, 0)

    def names(self):
        return sorted(self.stock)
'''

CODE_EDIT: tuple[tuple[str, str, str], ...] = (
    (_PRICES, "subtotal", "net"),
    (_INVENTORY, "stock", "items"),
    (_PRICES, "item", "entry"),
    (_INVENTORY, "count", "quantity"),
)


def code_edit_prompt(code: str, old: str, new: str) -> str:
    return (f"Rewrite this Python code, renaming `{old}` to `{new}` everywhere. Output only the "
            f"complete code, nothing else.\n\n{code}")


def workloads(n_jobs: int, max_tokens: int) -> dict[str, Workload]:
    """``chat`` and ``code_edit``, ``n_jobs`` jobs each."""
    chat = tuple(Job(i, ({"role": "user", "content": CHAT[i % len(CHAT)]},), max_tokens)
                 for i in range(n_jobs))
    edit = tuple(Job(i, ({"role": "user", "content": code_edit_prompt(*CODE_EDIT[i % len(CODE_EDIT)])},),
                     max_tokens) for i in range(n_jobs))
    return {"chat": Workload(101, chat), "code_edit": Workload(102, edit)}
