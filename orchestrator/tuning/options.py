"""Which `tuning:` options the planner reads, and the one line naming the rest.

The config's `tuning:` section (config.TuningConfig) feeds the one planner of `speculation.lengths: auto`, the
goodput planner (batch_model.BatchPlanner), on every path: batched steps (polyspec batch, jobs, serve) and one
request at a time (generate, chat, bench, batching.enabled: false), embedded, the device round or Ray. With
the lengths fixed, or --no-speculation, no planner runs (the lengths are the config's).

A Ray chain runs every tier in every round (its repair loop routes around dead tiers), so the options about
leaving tiers out mean nothing there, and its round hears no shadow proposals. An option set in the config
that the run does not read (those two on a Ray chain; any, with the lengths fixed) is named in one line on
stderr when the engine starts (`note`), never ignored silently.
"""

from __future__ import annotations

GOODPUT = "goodput planner"

_ALL = ("max_length", "switch_hysteresis", "decay", "prior_mean", "prior_strength", "allow_bypass", "explore_every", "shadow")
# distributed -> the options the planner reads
READS = {
    False: _ALL,
    True: tuple(name for name in _ALL if name not in ("allow_bypass", "shadow")),
}


def set_options(tuning) -> list[str]:
    """The options the config wrote (`TuningConfig.given`) or that differ from their defaults, in the section's order."""
    defaults = type(tuning)()
    given = set(getattr(tuning, "given", ()))
    return [name for name in _ALL if name in given or getattr(tuning, name) != getattr(defaults, name)]


def planner_of(lengths_auto: bool, speculative: bool, tiers: int) -> str | None:
    """The planner a run has: GOODPUT, for batched steps and one request at a time alike; None: no planner."""
    if not (lengths_auto and speculative and tiers > 1):
        return None
    return GOODPUT


def note(tuning, planner: str | None, distributed: bool = False) -> str | None:
    """One line naming the set options `planner` does not read on this path (None: it reads them all)."""
    written = set_options(tuning)
    if planner is None:
        return (f"tuning: {', '.join(written)} set, but no planner runs (speculation.lengths is fixed, or speculation "
                f"is off): these options are read with speculation.lengths: auto") if written else None
    reads = READS[distributed]
    unread = [name for name in written if name not in reads]
    if not unread:
        return None
    return (f"tuning: {', '.join(unread)} set, but a Ray chain runs every tier in every round, hearing no shadow "
            f"proposals, so the {planner} does not read {'it' if len(unread) == 1 else 'them'} there; it reads {', '.join(reads)}")


def goodput_options(tuning, distributed: bool = False) -> dict:
    """The goodput planner's keyword arguments from `tuning`: max_length, allow_bypass, explore_every and shadow
    always; decay, prior_mean, prior_strength and switch_hysteresis where the config set them (the planner's
    own defaults suit its rounds: acceptance fading over ~128 rounds, a prior of 0.8 for a model drafter and
    0.5 for a lookup worth 4 tokens, speculation switched on at 1.05 times off's measured tokens/s)."""
    written = set(set_options(tuning))
    options = {"max_length": tuning.max_length, "allow_bypass": tuning.allow_bypass and not distributed,
               "explore_every": tuning.explore_every, "shadows": tuning.shadow}
    for name, keyword, value in (("decay", "decay", tuning.decay), ("prior_mean", "prior_rate", tuning.prior_mean),
                                 ("prior_strength", "prior_weight", tuning.prior_strength),
                                 ("switch_hysteresis", "switch_on", 1.0 + tuning.switch_hysteresis)):
        if name in written:
            options[keyword] = value
    return options
