"""Host cost of packing one decode step's page tables (``specjax.batch.build_batch``), from
the rows' page-id lists against their ``RequestState.page_array`` views (what the engine
packs since the KV-context growth of the step's host time was traced to it:
``docs/gpu/cost_model_check/README.md``). No device, no model: B rows of
``context / page_size`` pages each, every call timed ``--calls`` times, ``--repeats`` times.

  python -m benchmarks.step_packing --batch_sizes=16,64,128 --contexts=512,2048

Prints per (batch, context) the mean ± std microseconds of each and their ratio.
"""

from __future__ import annotations

import timeit

import numpy as np
import pandas as pd
from absl import flags

from harness import cli
from specjax.batch import build_batch
from specjax.request import Request, RequestState

_BATCHES = flags.DEFINE_list("batch_sizes", ["16", "64", "128"], "Rows B per step.")
_CONTEXTS = flags.DEFINE_list("contexts", ["512", "2048"], "KV positions per row.")
_PAGE = flags.DEFINE_integer("page_size", 16, "Tokens per KV page.")
_CALLS = flags.DEFINE_integer("calls", 200, "Calls per timed repeat.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed repeats (mean ± std over them).")


def _time_us(fn) -> tuple[float, float]:
  ts = [1e6 * timeit.timeit(fn, number=_CALLS.value) / _CALLS.value
        for _ in range(_REPEATS.value)]
  return float(np.mean(ts)), float(np.std(ts))


def main(argv):
  del argv
  rows = []
  for batch in map(int, _BATCHES.value):
    for context in map(int, _CONTEXTS.value):
      width = -(-context // _PAGE.value)
      states = []
      for i in range(batch):
        st = RequestState(Request(str(i), (1,)), np.zeros(2, np.uint32), [1])
        st.add_pages(list(range(i * width, (i + 1) * width)))
        states.append(st)

      def pack(arrays: bool, states=states, batch=batch, width=width):
        tables = [st.page_array()[:width] if arrays else st.pages[:width] for st in states]
        return build_batch(batch=batch, width=width, length=0, page_tables=tables,
                           slots=list(range(batch)), verify_caps=[4] * batch)

      if not np.array_equal(pack(False).ints, pack(True).ints):
        raise AssertionError("page_array packs another table than the lists")
      (l_us, l_std), (a_us, a_std) = _time_us(lambda: pack(False)), _time_us(lambda: pack(True))
      rows.append({"batch": batch, "context": context, "pages_per_row": width,
                   "lists_us": l_us, "lists_std_us": l_std, "page_array_us": a_us,
                   "page_array_std_us": a_std, "ratio": l_us / a_us})
  print(pd.DataFrame(rows).round(2).to_string(index=False))


if __name__ == "__main__":
  cli.run(main)
