"""Write a randomly initialised model of a published model's shape (layers, widths, vocabulary).

    python tools/make_shape_model.py --shape qwen3-0.6b --out /tmp/qwen3-0.6b

The code is :mod:`rlflow.demo.shape_model`; ``--help`` lists the options.
"""

from rlflow.demo.shape_model import main

if __name__ == "__main__":
    main()
