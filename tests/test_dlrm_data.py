"""examples/criteo.py's reader and scripts/make_criteo.py's generator against a
plain-Python reference of Criteo's format and DLRM's preprocessing (single process, no
MPI, no torch)."""

import gzip
import importlib.util
import math

import numpy as np
import pytest

from helpers import ROOT


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


criteo = _load("criteo", ROOT / "examples" / "criteo.py")
make_criteo = _load("make_criteo", ROOT / "scripts" / "make_criteo.py")

#: Table sizes of mixed magnitudes (one of 1 row: every hash on row 0).
SIZES = [1, 7, 1000, 65536, 2 ** 31 - 1, 100_000] + [997] * 20


def reference(line: str, sizes) -> tuple[float, list[float], list[int]]:
    """One line as DLRM's reference preprocesses it: missing -> 0, negative integers -> 0,
    log(1 + x); hash -> int(hash, 16) % table size."""
    fields = line.rstrip("\n").split("\t")
    assert len(fields) == 40
    ints = [int(x) if x else 0 for x in fields[1:14]]
    hashes = [int(x, 16) if x else 0 for x in fields[14:]]
    return (float(fields[0]), [math.log1p(max(v, 0)) for v in ints], [h % n for h, n in zip(hashes, sizes)])


def reference_batches(files, batch_size, sizes, epochs=1):
    lines = [line for _ in range(epochs) for f in files for line in f.read_text().splitlines(keepends=True)]
    out = []
    for g in range(len(lines) // batch_size):
        rows = [reference(x, sizes) for x in lines[g * batch_size:(g + 1) * batch_size]]
        out.append({"label": np.array([r[0] for r in rows], np.float32),
                    "dense": np.array([r[1] for r in rows], np.float64),
                    "sparse": np.array([r[2] for r in rows], np.int64)})
    return out


def assert_batch_equal(got, want):
    assert got.keys() == {"label", "dense", "sparse"}
    assert got["label"].dtype == np.float32 and got["dense"].dtype == np.float32 and got["sparse"].dtype == np.int64
    np.testing.assert_array_equal(got["label"], want["label"])
    np.testing.assert_allclose(got["dense"], want["dense"], rtol=1e-6)
    np.testing.assert_array_equal(got["sparse"], want["sparse"])


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    out = tmp_path_factory.mktemp("criteo")
    summary = make_criteo.generate(out, rows=3001, files=3, seed=5, max_cardinality=5000)
    return out, summary


def test_generator_writes_criteo_lines(generated):
    out, summary = generated
    files = criteo.list_files([out])
    assert [f.name for f in files] == ["part-00000.tsv", "part-00001.tsv", "part-00002.tsv"]
    lines = [x for f in files for x in f.read_text().splitlines()]
    assert len(lines) == summary["rows"] == 3001
    assert [len(f.read_text().splitlines()) for f in files] == [1000, 1000, 1001]
    fields = [x.split("\t") for x in lines]
    assert {len(f) for f in fields} == {40}
    assert {f[0] for f in fields} == {"0", "1"}
    ints = [x for f in fields for x in f[1:14]]
    hashes = [x for f in fields for x in f[14:]]
    assert all(x == "" or x.lstrip("-").isdigit() for x in ints)
    assert all(x == "" or (len(x) == 8 and int(x, 16) >= 0 and x == x.lower()) for x in hashes)
    assert "" in ints and "" in hashes and any(x.startswith("-") for x in ints)  # missing and negative values
    labels = np.array([int(f[0]) for f in fields])
    assert summary["click_rate"] == pytest.approx(labels.mean())
    assert 0.18 < labels.mean() < 0.32  # --ctr 0.25
    # a signal to learn: the hidden model's own AUC on the rows
    assert summary["hidden_model_auc"] > 0.75


def test_generator_is_deterministic_and_zipf(generated, tmp_path):
    out, _ = generated
    make_criteo.generate(tmp_path, rows=3001, files=3, seed=5, max_cardinality=5000)
    for f in criteo.list_files([out]):
        assert (tmp_path / f.name).read_bytes() == f.read_bytes()
    # cat_0's values by frequency: value rank k is category_hash(0, k) with P(k) ~ 1/(k+1)^1.1
    column = [x.split("\t")[14] for f in criteo.list_files([out]) for x in f.read_text().splitlines()]
    values, counts = np.unique([c for c in column if c], return_counts=True)
    top = values[np.argsort(-counts)][:2]
    assert list(top) == ["%08x" % make_criteo.category_hash(0, k) for k in (0, 1)]
    cards = min(make_criteo.KAGGLE_CARDINALITIES[0], 5000)
    p = 1 / np.arange(1, cards + 1) ** 1.1
    assert counts.max() / sum(counts) == pytest.approx(p[0] / p.sum(), abs=0.03)


def test_parse_lines_equals_the_reference(generated):
    out, _ = generated
    files = criteo.list_files([out])
    lines = files[0].read_bytes().splitlines(keepends=True)[:500]
    got = criteo.parse_lines(lines, SIZES)
    want = reference_batches([files[0]], 500, SIZES)[0]
    assert_batch_equal(got, want)
    # without newlines, with \r\n, upper-case and short hashes
    extra = [b"1\t5\t-7\t\t0\t1\t2\t3\t4\t5\t6\t7\t8\t99" + b"\tABCDEF01\t1f\t\t" + b"\t".join([b"0"] * 23) + b"\r\n",
             b"0" + b"\t" * 39]
    got = criteo.parse_lines(extra, SIZES)
    want = [reference(x.decode().replace("\r", ""), SIZES) for x in extra]
    np.testing.assert_array_equal(got["sparse"], [w[2] for w in want])
    np.testing.assert_allclose(got["dense"], [w[1] for w in want], rtol=1e-6)
    assert got["dense"][0, 1] == 0 and got["sparse"][1].tolist() == [0] * 26  # negative and missing values


@pytest.mark.parametrize("shards, offset", [(1, 0), (2, 0), (3, 1), (4, 5)])
def test_batches_are_the_global_sequence_sharded(generated, shards, offset):
    """Shard i of n yields global batches offset + i, offset + i + n, ... of the files'
    lines as one stream (batches span file boundaries: 1000 lines a file, 64 a batch);
    together the shards yield every batch once; the last partial batch is dropped."""
    out, _ = generated
    files = criteo.list_files([out])
    want = reference_batches(files, 64, SIZES)
    assert len(want) == 3001 // 64
    seen = []
    for i in range(shards):
        got = list(criteo.batches(files, 64, SIZES, shard_index=i, num_shards=shards, offset=offset))
        expected = list(range(offset + i, len(want), shards))
        assert len(got) == len(expected)
        for batch, g in zip(got, expected):
            assert_batch_equal(batch, want[g])
        seen += expected
    assert sorted(seen) == list(range(offset, len(want)))


def test_epochs_and_make_dataset_offset(generated):
    out, _ = generated
    files = criteo.list_files([out])
    want = reference_batches(files, 500, SIZES, epochs=2)
    assert len(want) == 12  # 6002 lines: batch 6 spans the two passes
    load = criteo.make_dataset([out], batch_size=500, num_embeddings=SIZES, epochs=2)
    got = list(load(1, 2, offset=3))
    assert len(got) == len(range(4, 12, 2))
    for batch, g in zip(got, range(4, 12, 2)):
        assert_batch_equal(batch, want[g])


def test_gzip_files_and_natural_order(generated, tmp_path):
    out, _ = generated
    files = criteo.list_files([out])
    for k, f in enumerate(files):  # day_2 before day_10, as Criteo Terabyte's day_N names
        with gzip.open(tmp_path / f"day_{[2, 10, 11][k]}.gz", "wb") as g:
            g.write(f.read_bytes())
    assert [f.name for f in criteo.list_files([tmp_path])] == ["day_2.gz", "day_10.gz", "day_11.gz"]
    got = list(criteo.batches(criteo.list_files([tmp_path]), 1000, SIZES))
    want = reference_batches(files, 1000, SIZES)
    assert len(got) == len(want) == 3
    for a, b in zip(got, want):
        assert_batch_equal(a, b)


GOOD = "0\t1\t2\t3\t4\t5\t6\t7\t8\t9\t10\t11\t12\t13\t" + "\t".join(["0123abcd"] * 26)


def _with(field: int, value: str) -> str:
    fields = GOOD.split("\t")
    fields[field] = value
    return "\t".join(fields)


@pytest.mark.parametrize("line, message", [
    ("", "expected 40 tab-separated fields .*got 1"),
    (GOOD + "\t", "expected 40 tab-separated fields .*got 41"),
    (GOOD.rsplit("\t", 1)[0], "expected 40 tab-separated fields .*got 39"),
    (GOOD.replace("\t", " "), "expected 40 tab-separated fields .*got 1"),
    (_with(0, "2"), r"field 0 \(label\) expected the label 0 or 1, got b'2'"),
    (_with(0, ""), r"field 0 \(label\)"),
    (_with(1, "1.5"), r"field 1 \(int_0\) expected empty or a decimal integer"),
    (_with(3, " 12"), r"field 3 \(int_2\)"),
    (_with(13, "+4"), r"field 13 \(int_12\)"),
    (_with(5, "1" * 19), r"field 5 \(int_4\)"),
    (_with(14, "0x12abcd"), r"field 14 \(cat_0\) expected empty or a hash of 1-8 hexadecimal digits, got b'0x12abcd'"),
    (_with(20, "123456789"), r"field 20 \(cat_6\)"),
    (_with(39, "-1f"), r"field 39 \(cat_25\)"),
    (_with(30, "g" * 100), r"field 30 \(cat_16\) .*got b'g{40}'\.\.\.$"),  # long values are cut
])
def test_malformed_lines_name_file_line_and_field(tmp_path, line, message):
    good = GOOD + "\n"
    path = tmp_path / "day_0"
    path.write_text(good * 5 + line + "\n" + good * 2)
    with pytest.raises(criteo.CriteoFormatError, match=f"^{path}:6: {message}"):
        list(criteo.batches([path], 4, SIZES))
    # The shard that does not own the batch of line 6 reads past it: only its batches are parsed.
    assert len(list(criteo.batches([path], 4, SIZES, shard_index=0, num_shards=2))) == 1


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_embeddings"):
        criteo.parse_lines([GOOD.encode()], [10] * 25)
    with pytest.raises(ValueError, match="num_embeddings"):
        criteo.parse_lines([GOOD.encode()], [0] + [10] * 25)
    with pytest.raises(ValueError, match="shard"):
        next(criteo.batches([], 4, SIZES, shard_index=2, num_shards=2))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        criteo.list_files([ROOT / "no-such-criteo-file"])


def test_an_empty_directory_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no file"):
        criteo.list_files([tmp_path])
