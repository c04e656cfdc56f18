"""Prints KV memory per token for the zoo shapes and methods (``harness.kv_memory``).

  python -m experiments.kv_memory [--dtype=bfloat16] [--output_csv=kv_memory.csv]
"""

from __future__ import annotations

from absl import flags

from harness import cli
from harness.kv_memory import DEFAULT_PAIRS, memory_table

_DTYPE = flags.DEFINE_string("dtype", None, "KV dtype (default: each shape's own, bf16).")
_K = flags.DEFINE_integer("num_speculative_tokens", 4, "k of the method configs.")
_METHODS = flags.DEFINE_list("methods", ["ar", "ngram", "draft_model", "eagle3"], "Methods.")
_CSV = flags.DEFINE_string("output_csv", None, "Also write the table here.")


def main(argv):
  del argv
  df = memory_table(DEFAULT_PAIRS, tuple(_METHODS.value), _DTYPE.value, _K.value)
  print(df.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
  if _CSV.value:
    df.to_csv(_CSV.value, index=False)


if __name__ == "__main__":
  cli.run(main)
