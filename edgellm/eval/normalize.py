"""Value normalisation for scoring extracted fields: numbers, dates, times, whitespace, case."""

from __future__ import annotations

import re
import unicodedata
from datetime import date
from typing import Any

DATE_PATTERN = r"^\d{4}-\d{2}-\d{2}$"
TIME_PATTERN = r"^\d{2}:\d{2}$"
_MONTHS = {m: i + 1 for i, m in enumerate(
    ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"])}
_STRIP = " \t\n\r\"'`.,;:!?，。；：！？、“”‘’「」（）()[]【】"


def text(value: Any) -> str:
    """NFKC, case-folded, inner whitespace collapsed, surrounding punctuation/quotes removed."""
    s = unicodedata.normalize("NFKC", str(value)).casefold()
    return re.sub(r"\s+", " ", s).strip(_STRIP)


def number(value: Any) -> float | None:
    """A number from a number or a string like '$1,250.00', '¥35', '35元', '12 USD'; None if none."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    m = re.search(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+", unicodedata.normalize("NFKC", str(value)))
    if not m:
        return None
    try:
        return float(m.group().replace(",", ""))
    except ValueError:
        return None


def iso_date(value: Any) -> str | None:
    """'2025-03-07', '2025/3/7', '2025年3月7日', 'March 7, 2025', '7 March 2025' → '2025-03-07'."""
    s = unicodedata.normalize("NFKC", str(value)).strip().lower()
    patterns = [
        (r"(\d{4})\s*[-/.年]\s*(\d{1,2})\s*[-/.月]\s*(\d{1,2})", ("y", "m", "d")),
        (r"([a-z]{3})[a-z]*\.?\s+(\d{1,2})(?:st|nd|rd|th)?,?\s+(\d{4})", ("mon", "d", "y")),
        (r"(\d{1,2})(?:st|nd|rd|th)?\s+([a-z]{3})[a-z]*\.?,?\s+(\d{4})", ("d", "mon", "y")),
    ]
    for pattern, order in patterns:
        m = re.search(pattern, s)
        if not m:
            continue
        parts = dict(zip(order, m.groups()))
        month = _MONTHS.get(parts["mon"]) if "mon" in parts else int(parts["m"])
        try:
            return date(int(parts["y"]), month or 0, int(parts["d"])).isoformat()
        except ValueError:
            return None
    return None


def clock(value: Any) -> str | None:
    """'6:30', '06:30', '6:30 am', '2:45 PM', '14:45:00', '下午3点半' → 'HH:MM' (24-hour)."""
    s = unicodedata.normalize("NFKC", str(value)).strip().lower()
    m = re.search(r"(\d{1,2})(?::(\d{2}))?(?::\d{2})?\s*(am|pm|a\.m\.|p\.m\.)?", s)
    if not m or (m.group(2) is None and m.group(3) is None and "点" not in s):
        return None
    h, mi = int(m.group(1)), int(m.group(2) or 0)
    if "点半" in s:
        mi = 30
    pm = (m.group(3) or "").startswith("p") or any(w in s for w in ("下午", "晚上"))
    am = (m.group(3) or "").startswith("a")
    if pm and h < 12:
        h += 12
    if am and h == 12:
        h = 0
    return f"{h:02d}:{mi:02d}" if h < 24 and mi < 60 else None


def boolean(value: Any) -> bool | None:
    if isinstance(value, bool):
        return value
    s = text(value)
    return True if s in ("true", "yes", "1", "是") else False if s in ("false", "no", "0", "否") else None


def normalize(value: Any, schema: dict[str, Any]) -> Any:
    """Canonical form of `value` for a property with this JSON Schema (None if it cannot be read)."""
    if value is None:
        return None
    kind = schema.get("type")
    if kind in ("number", "integer"):
        n = number(value)
        return None if n is None else round(n, 6)
    if kind == "boolean":
        return boolean(value)
    if kind == "array":
        items = value if isinstance(value, list) else re.split(r"[,，、;；]|\band\b|和", str(value))
        return sorted(t for t in (normalize(v, schema.get("items", {})) for v in items) if t not in (None, ""))
    pattern = schema.get("pattern")
    if pattern == DATE_PATTERN:
        return iso_date(value)
    if pattern == TIME_PATTERN:
        return clock(value)
    return text(value)


def same(value: Any, gold: Any, schema: dict[str, Any]) -> bool:
    """Whether an extracted value equals the gold value after normalisation."""
    got, want = normalize(value, schema), normalize(gold, schema)
    return got is not None and got == want
