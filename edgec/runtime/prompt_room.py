"""Room for an `end` prompt's temporary state, checked before any of it is written.

With ``prefill_compress = end`` a prompt longer than the compressed capacity is read whole into a temporary state
of the compressed layers (``CacheSpec.end_prompt_bytes``), beside the slots, before its best slots are chosen.
Without room the prompt would end minutes later with the process killed or in swap (host memory, whose pages are
touched as the prompt goes), or with a bare allocation error (device memory): refuse at once, in one line.
"""

from __future__ import annotations

from edgec.errors import GenerationError


def check_prompt_room(length: int, needed: int, free: int | None, where: str) -> None:
    """Refuse a ``length``-token prompt whose temporary state takes ``needed`` bytes when ``free`` (None: unknown,
    not checked) is less; ``where``: what has ``free`` bytes, e.g. "this machine has available"."""
    if free is None or needed <= free:
        return
    gib = 2**30
    raise GenerationError(
        f"a {length}-token prompt is read whole before its slots are chosen (prefill_compress end): its "
        f"{needed / gib:.2f} GiB temporary state is more than the {free / gib:.2f} GiB {where}; load with "
        "prefill_compress='chunk' (edgec run --prefill-compress chunk), fewer tokens, or free memory"
    )
