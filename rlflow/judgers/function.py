"""``function``: a reward function given by import path, e.g. one written for ``trl.GRPOTrainer``, unchanged.

``{"class_path": "function", "init_args": {"path": "my_pkg.rewards:reward_fn"}}`` imports ``reward_fn`` and
calls it with TRL's keywords (``prompts``, ``completions``, ``completion_ids``, every dataset column,
``trainer_state``, ``log_extra`` and ``log_metric``: :mod:`rlflow.judgers.context`), or, where it takes no
``**kwargs``, with those of them its signature names.
``factory_kwargs`` covers TRL's reward factories (``get_soft_overlong_punishment(...)`` returns the function);
``rename`` passes a column under another keyword, e.g. ``{"solution": "ground_truth"}`` so TRL's
``accuracy_reward`` reads XTuner's ``reward_model.ground_truth``. The metric name is the function's
``__name__``, as in TRL. (A bare import path as the judger, ``"my_pkg.rewards:reward_fn"``, also works; this
class adds the options.) With ``data.judging.isolation: process`` the function runs in a worker process, where
the judger is rebuilt from its arguments (so a factory's closure works there too).
"""

from __future__ import annotations

from typing import Any

from rlflow import registry
from rlflow.judgers.base import Judger
from rlflow.judgers.context import accepted_keywords, select_keywords


class FunctionJudger(Judger):
    """Wraps an importable TRL-style reward function so a config can name it.

    Args:
        path: Import path of the function (``package.module:function``), or of a factory when ``factory_kwargs`` is set.
        factory_kwargs: If set, the object at ``path`` is called with these to make the reward function.
        rename: Extra keyword -> existing column passed under that keyword too (e.g. ``{"solution": "ground_truth"}``).
        name: Metric name; defaults to the function's ``__name__``.
    """

    def __init__(
        self,
        path: str,
        factory_kwargs: dict[str, Any] | None = None,
        rename: dict[str, str] | None = None,
        name: str | None = None,
    ) -> None:
        fn = registry.import_path(path)
        if factory_kwargs is not None:
            fn = fn(**factory_kwargs)
        if not callable(fn):
            raise TypeError(f"function judger: {path!r} is a {type(fn).__name__}, not a callable reward function")
        self.fn = fn
        self.accepts = accepted_keywords(fn)  # what fn is given after the renames
        self.path = path
        self.factory_kwargs = factory_kwargs
        self.rename = dict(rename or {})
        self.name = name or getattr(fn, "__name__", None) or type(fn).__name__

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickled as its arguments: a copy imports the function again (and calls the factory again), so a
        factory's closure reaches a judger's worker process (:mod:`rlflow.isolation`) too."""
        if type(self) is not FunctionJudger:  # a subclass's constructor may take other arguments
            return super().__reduce_ex__(protocol)
        return FunctionJudger, (self.path, self.factory_kwargs, self.rename, self.name)

    def __call__(self, **kwargs: Any) -> Any:
        for new, old in self.rename.items():
            if old not in kwargs:
                raise KeyError(
                    f"function judger {self.name!r}: rename maps {new!r} to column {old!r}, which the data lacks; "
                    f"columns: {sorted(kwargs)}"
                )
            kwargs[new] = kwargs[old]
        return self.fn(**select_keywords(kwargs, self.accepts))  # an async function's coroutine: awaited by the runner
