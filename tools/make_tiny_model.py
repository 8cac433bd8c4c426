"""Build the CPU demo's tiny Qwen3 policy and its arithmetic data.

    python tools/make_tiny_model.py --out checkpoints/tiny-qwen3 --data-out checkpoints/arith

The code is :mod:`rlflow.demo.tiny_model`; ``--help`` lists the options.
"""

from rlflow.demo.tiny_model import main

if __name__ == "__main__":
    main()
