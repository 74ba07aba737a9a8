"""`python -m model.choices`: every registered choice of the model's option
axes with its one-line doc (and what each attention implementation takes),
the table docs/models.md shows between its `choices` markers; a test holds
the page equal to it."""
from model.config import REGISTRIES


def _describe(entry) -> str:
  takes = getattr(entry, "takes", frozenset()) | getattr(entry, "shapes", frozenset())
  if not takes:
    return entry.doc
  return f"{entry.doc}; takes {', '.join(sorted(takes))}"


def choices_markdown() -> str:
  """The markdown table: field, choice, what it is."""
  rows = ["| field | choice | what it is |", "|---|---|---|"]
  for field, registry in REGISTRIES.items():
    rows += [f"| `{field}` | `{name}` | {_describe(entry)} |" for name, entry in registry.items()]
  return "\n".join(rows)


if __name__ == "__main__":
  print(choices_markdown())
