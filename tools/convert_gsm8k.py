"""Convert GSM8K as the Hugging Face hub lays it out into rlflow's RL jsonl rows.

    python tools/convert_gsm8k.py --input-dir ./gsm8k_data --out-dir ./gsm8k

The code is :mod:`rlflow.demo.gsm8k`; ``--help`` lists the options.
"""

from rlflow.demo.gsm8k import main

if __name__ == "__main__":
    raise SystemExit(main())
