"""Reward functions as TRL users have them, for ``rlflow fit`` runs: TRL's own factory output, and functions written
to TRL's documented signature (``trainer_state``, ``log_extra``, ``log_metric``)."""

from __future__ import annotations

from trl.rewards import get_soft_overlong_punishment

#: TRL's DAPO overlong penalty, built by its own factory for ``data.sampling.max_tokens=12``.
soft_overlong = get_soft_overlong_punishment(max_completion_len=12, soft_punish_cache=4)


def curriculum(prompts, completions, completion_ids, trainer_state, log_extra, log_metric, **kwargs):
    """A curriculum reward: the share of the run done so far (``global_step / max_steps``) times the completion's
    length, so the same completion earns more later in the run; logs the level per completion and as a metric, and
    whether the process is the first (``is_world_process_zero``)."""
    level = trainer_state.global_step / trainer_state.max_steps
    log_extra("curriculum_level", [level] * len(completions))
    log_extra("process_zero", [trainer_state.is_world_process_zero] * len(completions))
    log_metric("curriculum/level", level)
    return [level * len(ids) / 12 for ids in completion_ids]


def wrong_signature(completion, **kwargs):
    """A slip TRL users make: ``completion`` for ``completions``; it cannot work on any sample."""
    return [0.0]


def cannot_score(completions, **kwargs):
    """Callable as TRL calls reward functions, and failing on every call (a bug in its body)."""
    return [len(completions) + "x"]


def make_flaky(every: int):
    """A reward function that fails on every ``every``-th sample it sees (an infinite reward counts as failed)."""
    seen = [0]

    def flaky(completions, **kwargs):
        rewards = []
        for _ in completions:
            seen[0] += 1
            rewards.append(float("inf") if seen[0] % every == 0 else 0.0)
        return rewards

    return flaky
