"""Build the agentic demo's tiny tool-calling policy and its multiplication data.

    python tools/make_tiny_tool_model.py --out checkpoints/tiny-tool-qwen3 --data-out checkpoints/mult

The code is :mod:`rlflow.demo.tiny_tool_model`; ``--help`` lists the options.
"""

from rlflow.demo.tiny_tool_model import main

if __name__ == "__main__":
    main()
