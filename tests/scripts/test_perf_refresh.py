#!/usr/bin/env python3
"""scripts/perf_refresh.py on fixture outputs of the tool (tests/scripts/fixtures/) and, when --tool
names the built `megamoe`, on a fresh `megamoe bench --json` of the cpu backend, so a change of the
tool's JSON that the script cannot read fails here.

fixtures/: bench_cpu_tiny_ep2.json is a real `megamoe bench --backend cpu --json`; the routed one is
the same writer's format with a GPU backend's rows (stages_us, a case that did not run);
gemm_r*.json follow bench-gemm's records (gemm_cmd.cpp); transport_owner.json and link.json follow
bench-transport's and bench-link's --json (transport_cmd.cpp point_record, link_cmd.cpp
run_link_path); transport_owner.log holds the same numbers as bench-transport's two text tables.
  python3 tests/scripts/test_perf_refresh.py [--tool build/megamoe]
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SCRIPT = os.path.join(ROOT, "scripts", "perf_refresh.py")
FIX = os.path.join(HERE, "fixtures")
TOOL = None

PERF = """# Performance

Intro text that must survive.

<!-- perf-table: layer/routed/qwen3-30b-a3b/ep2 -->
old routed table
<!-- /perf-table -->

Between the tables.

<!-- perf-table: gemm/memset -->
| old | gemm |
<!-- /perf-table -->

<!-- perf-table: transport/fp8-bf16-owner -->
<!-- /perf-table -->

<!-- perf-table: layer/cpu/tiny/ep2 -->
<!-- /perf-table -->
Tail.
"""


def run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True)


def fixture(name):
    return os.path.join(FIX, name)


class PerfRefresh(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp()
        self.perf = os.path.join(self.dir, "PERF.md")
        with open(self.perf, "w") as f:
            f.write(PERF)

    def tearDown(self):
        shutil.rmtree(self.dir)

    def refresh(self, *files, extra=()):
        return run("--perf", self.perf, "--date", "2026-11-30", "--machine", "2 x H200", *extra,
                   *[fixture(f) for f in files])

    def text(self):
        with open(self.perf) as f:
            return f.read()

    def test_rewrites_only_the_marked_tables(self):
        r = self.refresh("bench_routed_qwen3_ep2.json", "gemm_r1.json", "gemm_r2.json", "transport_owner.log",
                         "bench_cpu_tiny_ep2.json")
        self.assertEqual(r.returncode, 0, r.stderr)
        t = self.text()
        for kept in ("Intro text that must survive.", "Between the tables.", "Tail.", "# Performance"):
            self.assertIn(kept, t)
        self.assertNotIn("old routed table", t)
        self.assertNotIn("| old | gemm |", t)
        # routed: the row, its stages (combine_send, an empty mark, left out), the case that did not run
        self.assertIn("| 8 | 114.7 (110.2–130.5) | 7.1 | 48.0 (hbm) | 2.39 | 19.7 | 18.5 | 40.4 | 22.5 | 13.4 |", t)
        self.assertIn("| 8192 | not run: host memory: needs 3.7 GB |", t)
        self.assertNotIn("combine_send", t)
        self.assertIn("2026-11-30, 2 x H200: `megamoe bench --preset qwen3-30b-a3b --backend routed --ep 2 "
                      "--tokens 8,256,8192 ", t)
        # gemm: two rounds folded (median 744.0 of 742.8 and 745.2), the target verdicts
        self.assertIn("| deepseek-v3 | fc1 | 32 | 512 | contiguous 128x256 x2 g132 | 2 | 744.0 (742.8-745.2) | 1293 |", t)
        self.assertIn("≥ 3.5 TB/s: no |", t)
        # transport: dispatch-only graph, combine = F - DP, d+c, pool, the gated and NCCL medians
        self.assertIn("| 1 | 8.8 | 0.9 | 8.4 | 0.4 | **17.2** | 11.6 | 15.0 / 12.0 | 16.4 / 12.5 |", t)
        self.assertIn("| 8192 | 183.2 | 327.5 | 458.2 | 256.3 | **641.4** | 120.1 | 190.1 / 470.0 | 246.0 / 1332.0 |", t)
        self.assertIn("--dispatch fp8 --combine bf16 --owner-reduce", t)
        # cpu rows keep their own time kind out of the table but run through the same path
        self.assertIn("| 16 | 12040.9 (8153.9–16082.6) |", t)
        # a second run changes nothing
        again = self.refresh("bench_routed_qwen3_ep2.json", "gemm_r1.json", "gemm_r2.json", "transport_owner.log",
                             "bench_cpu_tiny_ep2.json")
        self.assertEqual(again.returncode, 0, again.stderr)
        self.assertEqual(self.text(), t)

    def test_transport_json_gives_the_table_of_its_log(self):
        with open(self.perf, "w") as f:
            f.write("<!-- perf-table: transport/fp8-bf16-owner -->\n<!-- /perf-table -->\n")
        r = self.refresh("transport_owner.json")
        self.assertEqual(r.returncode, 0, r.stderr)
        t = self.text()
        self.assertIn("| 1 | 8.8 | 0.8 | 8.4 | 0.4 | **17.2** | 11.6 | 15.0 / 12.0 | 16.4 / 12.5 |", t)
        self.assertIn("| 8192 | 183.2 | 327.4 | 458.2 | 256.3 | **641.4** | 120.1 | 190.1 / 470.0 | 246.0 / 1332.0 |", t)
        self.assertIn("--owner-reduce --x fp8", t)

    def test_link_rows(self):
        with open(self.perf, "w") as f:
            f.write("<!-- perf-table: link -->\n<!-- /perf-table -->\n")
        r = self.refresh("link.json")
        self.assertEqual(r.returncode, 0, r.stderr)
        t = self.text()
        self.assertIn("| store | 2 x 512 threads per SM | 256 | 360.2 / 361.3 | 745.30 / 742.90 | 1.10 | ok |", t)
        self.assertIn("| handshake | 1 CTA, 64 launches per graph | 1 |", t)

    def test_one_bench_doc_of_two_backends_gives_a_table_each(self):
        with open(fixture("bench_routed_qwen3_ep2.json")) as f:
            doc = json.load(f)
        mega = json.loads(json.dumps(doc["rows"][0]))
        mega["backend"] = mega["resolved"] = "mega"
        mega["command"] = mega["command"].replace("--backend routed", "--backend mega") + " --shared-gpu --layers 4"
        mega["layers"] = 4
        doc["rows"].append(mega)
        path = os.path.join(self.dir, "two.json")
        with open(path, "w") as f:
            json.dump(doc, f)
        r = run("--perf", self.perf, "--dry-run", path)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("perf-table: layer/routed/qwen3-30b-a3b/ep2 -->", r.stdout)
        self.assertIn("perf-table: layer/mega/qwen3-30b-a3b/ep2-shared/layers4 -->", r.stdout)

    def test_missing_markers_name_the_table_and_write_nothing(self):
        with open(self.perf, "w") as f:
            f.write("# Performance\n<!-- perf-table: gemm/read -->\n<!-- /perf-table -->\n")
        before = self.text()
        r = self.refresh("bench_routed_qwen3_ep2.json")
        self.assertEqual(r.returncode, 2)
        self.assertIn("no markers for layer/routed/qwen3-30b-a3b/ep2", r.stderr)
        self.assertIn("marked now: gemm/read", r.stderr)
        self.assertEqual(self.text(), before)

    def test_table_option_and_flush(self):
        with open(self.perf, "w") as f:
            f.write("<!-- perf-table: gemm/decode-read -->\n<!-- /perf-table -->\n")
        r = self.refresh("gemm_r1.json", extra=("--table", "gemm/decode-read", "--flush", "read"))
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("--flush read --json F", self.text())

    def test_unbalanced_markers_are_refused(self):
        with open(self.perf, "w") as f:
            f.write("<!-- perf-table: gemm/memset -->\n| x |\n")
        r = self.refresh("gemm_r1.json")
        self.assertEqual(r.returncode, 2)
        self.assertIn("has no '<!-- /perf-table -->'", r.stderr)

    def test_not_a_tool_output(self):
        bad = os.path.join(self.dir, "x.json")
        with open(bad, "w") as f:
            f.write('{"hello": 1}')
        r = run("--perf", self.perf, bad)
        self.assertEqual(r.returncode, 2)
        self.assertIn("not a megamoe bench, bench-gemm, bench-transport or bench-link output", r.stderr)

    def test_history_entry_and_index(self):
        hist = os.path.join(self.dir, "perf-history")
        os.mkdir(hist)
        with open(os.path.join(hist, "README.md"), "w") as f:
            f.write("# index\n")
        entry = os.path.join(hist, "2026-12-01-gemm.md")
        r = self.refresh("gemm_r1.json", extra=("--history", entry))
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("## gemm/memset", open(entry).read())
        self.assertIn("[2026-12-01-gemm.md](2026-12-01-gemm.md): gemm/memset", open(os.path.join(hist, "README.md")).read())

    def test_docs_perf_md_marks_its_tables(self):
        r = run("--list", "--perf", os.path.join(ROOT, "docs", "PERF.md"))
        self.assertEqual(r.returncode, 0, r.stderr)
        for name in ("layer/routed/deepseek-v3/ep2", "layer/routed/qwen3-30b-a3b/ep2", "gemm/memset",
                     "transport/fp8-bf16-owner", "link"):
            self.assertIn(name + ":", r.stdout)
        self.assertLessEqual(len(open(os.path.join(ROOT, "docs", "PERF.md")).read().splitlines()), 300)

    def test_fresh_bench_json_of_the_tool(self):
        if not TOOL:
            self.skipTest("no --tool given")
        out = os.path.join(self.dir, "bench.json")
        b = subprocess.run([TOOL, "bench", "--preset", "tiny", "--backend", "cpu", "--ep", "2", "--tokens", "1,4",
                            "--iters", "2", "--warmup", "1", "--json", out], capture_output=True, text=True)
        self.assertEqual(b.returncode, 0, b.stderr)
        r = run("--perf", self.perf, "--machine", "this host", out)
        self.assertEqual(r.returncode, 0, r.stderr)
        t = self.text()
        self.assertIn("`megamoe bench --preset tiny --backend cpu --ep 2 --tokens 1,4 ", t)
        self.assertRegex(t, r"\n\| 4 \| [0-9.]+ \([0-9.]+–[0-9.]+\) \|")


if __name__ == "__main__":
    if "--tool" in sys.argv:
        i = sys.argv.index("--tool")
        TOOL = sys.argv[i + 1]
        del sys.argv[i:i + 2]
    unittest.main()
