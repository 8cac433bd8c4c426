"""What the tests share: paths (``paths``), ``rlflow fit`` arguments (``fit``), tiny models and tokenizers
(``tiny_archs``, ``tiny_vlm``, ``multiturn_helpers``), judgers and run comparisons (``reward_helpers``,
``resume_helpers``). Imported as ``tests.helpers.<module>``, also by dotted path in the configs the tests pass to
``rlflow fit`` (the repository root is on ``sys.path``: pytest's ``pythonpath``, ``PYTHONPATH`` in subprocesses)."""
