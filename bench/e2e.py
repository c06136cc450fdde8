"""End-to-end benchmark on the H200 (see transformers_kimi3/benchmark.py for the stages):

    python bench/e2e.py --out bench/results/e2e_h200.json --budget-s 240
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from transformers_kimi3.benchmark import main, print_table  # noqa: E402

if __name__ == "__main__":
    print_table(main())
