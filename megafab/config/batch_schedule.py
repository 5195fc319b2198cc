"""--step-batch-size-schedule (Megatron-LM after core 0.16): the global batch by consumed tokens.

"THRESHOLD:BATCH THRESHOLD:BATCH ..." (commas separate entries too); a number may end in K, M, B
or T (1e3 .. 1e12, any case, decimals allowed: 2.4B) and is int(float(digits) * multiplier). A
threshold counts tokens and becomes samples as threshold // seq_length; the entries are sorted by
threshold, which must then start at 0 and strictly increase; batches are positive. The batch at
`consumed` samples is that of the last entry whose threshold <= consumed. A run of --train-samples
lasts the steps taken while consumed < train_samples (the last step may pass it).

megatron-core's StepBatchsizeNumMicroBatchesCalculator (_parse_numeric_value, _parse_schedule,
_validate_schedule, _get_batch_size_for_samples) and megatron.training's update_train_iters.
"""

from __future__ import annotations

import bisect
import functools

SUFFIXES = {"T": 1_000_000_000_000, "B": 1_000_000_000, "M": 1_000_000, "K": 1_000}
EXAMPLE = '"0:16 2.4B:320 12B:1536"'


def parse_number(text: str) -> int:
    """Megatron's _parse_numeric_value; ValueError naming the text when it is not a number."""
    digits = text.strip().upper()
    multiplier = SUFFIXES.get(digits[-1:], 1)
    if multiplier != 1:
        digits = digits[:-1]
    try:
        return int(float(digits) * multiplier)
    except (ValueError, OverflowError):
        raise ValueError(f"{text!r} is not a number (digits with an optional K, M, B or T suffix)") from None


@functools.lru_cache(maxsize=16)
def parse_step_schedule(text: str, seq_length: int | None) -> tuple[tuple[int, int], ...]:
    """((threshold in samples, global batch), ...) sorted; ValueError (one line) when it breaks a rule.
    seq_length None: the thresholds are samples already."""
    schedule = []
    for entry in text.strip().replace(",", " ").split():
        if ":" not in entry:
            raise ValueError(f"entry {entry!r} is not THRESHOLD:BATCH_SIZE (e.g. {EXAMPLE})")
        threshold_text, batch_text = entry.split(":", 1)
        threshold, batch = parse_number(threshold_text), parse_number(batch_text)
        schedule.append((threshold // seq_length if seq_length is not None else threshold, batch))
    schedule.sort(key=lambda e: e[0])
    unit = f"samples of --seq-length {seq_length} tokens" if seq_length is not None else "samples"
    if not schedule:
        raise ValueError(f"no entry; give THRESHOLD:BATCH_SIZE pairs, e.g. {EXAMPLE}")
    if schedule[0][0] != 0:
        raise ValueError(f"the first threshold must be 0 (the batch from the start), got {schedule[0][0]} "
                         f"{unit}")
    for (before, _), (after, _) in zip(schedule, schedule[1:]):
        if after <= before:
            raise ValueError(f"thresholds must strictly increase, got {before} twice ({unit}); drop or "
                             f"move one")
    bad = [b for _, b in schedule if b <= 0]
    if bad:
        raise ValueError(f"batch size {bad[0]} must be positive")
    return tuple(schedule)


def batch_at(schedule: tuple[tuple[int, int], ...], consumed_samples: int) -> int:
    """The global batch of the step that starts with `consumed_samples` consumed."""
    thresholds = [t for t, _ in schedule]
    return schedule[max(bisect.bisect_right(thresholds, consumed_samples) - 1, 0)][1]


def iterations_for(schedule: tuple[tuple[int, int], ...], train_samples: int) -> int:
    """Steps while consumed < train_samples, each consuming batch_at(consumed) (Megatron's loop, by
    whole segments of the schedule)."""
    iterations = consumed = 0
    ends = [t for t, _ in schedule[1:]] + [train_samples]
    for (_, batch), end in zip(schedule, ends):
        end = min(end, train_samples)
        if consumed < end:
            steps = -(-(end - consumed) // batch)
            iterations, consumed = iterations + steps, consumed + steps * batch
    return iterations


def final_scheduled_batch(text: str | None, seq_length: int | None) -> int | None:
    """The schedule's last batch (its steady state); None without a schedule or with a broken one
    (the rules report it)."""
    if text is None:
        return None
    try:
        return parse_step_schedule(text, seq_length)[-1][1]
    except ValueError:
        return None


def schedule_note(text: str | None, seq_length: int | None, per_step: int) -> str | None:
    """The start-up line of the schedule as Megatron logs it: each entry's first sample (and token),
    global batch and micro-batches (per_step: micro batch x dp)."""
    if text is None:
        return None
    try:
        schedule = parse_step_schedule(text, seq_length)
    except ValueError:
        return None
    tokens = seq_length or 1
    return "step batch size schedule: " + "; ".join(
        f">= {t * tokens:,} tokens ({t:,} samples) -> batch {b}" + (f", {b // per_step} micro-batches"
                                                                     if per_step else "")
        for t, b in schedule)
