"""``harness.device_time`` on a hand-written trace, and ``benchmarks.hlo_fusions`` on a
hand-written HLO dump (CPU traces have no device track, so neither comes from a run)."""

import gzip
import json
import os

import pytest

from benchmarks import hlo_fusions
from harness import device_time


def _trace(tmp_path, events):
  d = tmp_path / "plugins" / "profile" / "run"
  os.makedirs(d)
  meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
          {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}}]
  with gzip.open(d / "host.trace.json.gz", "wt") as f:
    json.dump({"traceEvents": meta + events}, f)
  return str(tmp_path)


def test_busy_time_top_ops_and_sources(tmp_path):
  trace = _trace(tmp_path, [
      {"ph": "X", "pid": 1, "name": "fusion_7", "ts": 0, "dur": 10,
       "args": {"hlo_module": "jit_step", "hlo_op": "fusion.7"}},
      {"ph": "X", "pid": 1, "name": "fusion_7", "ts": 5, "dur": 10,  # overlaps the first
       "args": {"hlo_module": "jit_step", "hlo_op": "fusion.7"}},
      {"ph": "X", "pid": 1, "name": "memcpy", "ts": 100, "dur": 4},
      {"ph": "X", "pid": 2, "name": "host_work", "ts": 0, "dur": 1000},
  ])
  assert device_time.device_busy_seconds(trace) == pytest.approx(19e-6)
  assert device_time.top_ops(trace, reps=2, fold=False) == [
      ("fusion_7", pytest.approx(0.01), 1), ("memcpy", pytest.approx(0.002), 0)]
  assert device_time.op_sources(trace) == {
      "fusion_7": {"hlo_module": "jit_step", "hlo_op": "fusion.7"}}
  assert device_time.ops_table(trace, reps=2) == [
      dict(op="fusion_7", ms_per_step=pytest.approx(0.01), calls_per_step=1,
           hlo_module="jit_step", hlo_op="fusion.7"),
      dict(op="memcpy", ms_per_step=pytest.approx(0.002), calls_per_step=0, hlo_module="",
           hlo_op="")]


HLO = """HloModule jit_step, entry_computation_layout={()->f32[8]}

%fused_computation.1 (param_0.4: f32[4,8]) -> f32[8] {
  %param_0.4 = f32[4,8]{1,0} parameter(0)
  %constant.2 = f32[] constant(0)
  ROOT %reduce_sum.0 = f32[8]{0} reduce(%param_0.4, %constant.2), dimensions={0}, to_apply=%add
}

ENTRY %main.3 (x: f32[4,8]) -> f32[8] {
  %x = f32[4,8]{1,0} parameter(0)
  ROOT %input_fusion.7 = f32[8]{0} fusion(%x), kind=kInput, calls=%fused_computation.1, metadata={op_name="jit(step)/reduce_sum"}
}
"""


def test_hlo_fusions_finds_the_instruction_and_its_computation(tmp_path):
  path = tmp_path / "module_0001.jit_step.sm_9.0_gpu_after_optimizations.txt"
  path.write_text(HLO)
  files = [str(path)]
  by_source = hlo_fusions.describe("input_fusion_7", "jit_step", "input_fusion.7", files,
                                   max_lines=10)
  by_kernel = hlo_fusions.describe("input_fusion_7", "", "", files, max_lines=10)
  in_graph = hlo_fusions.describe("input_fusion_7", "jit_step", "command_buffer_3", files, 10)
  assert by_source == by_kernel == in_graph
  assert "ROOT %input_fusion.7 = f32[8]{0} fusion(%x)" in by_source[0]
  assert any("reduce_sum.0 = f32[8]{0} reduce" in line for line in by_source)
  assert hlo_fusions.describe("input_fusion_7", "jit_other", "input_fusion.7", files, 10) == [
      "  (not found in the dump)"]
  assert len(hlo_fusions.describe("input_fusion_7", "", "", files, max_lines=2)) == 4
