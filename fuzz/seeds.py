"""Write seed corpora for the harnesses: valid files plus every hostile variant's files.

    python fuzz/seeds.py OUT   ->  OUT/safetensors, OUT/torch_save, OUT/dcp, OUT/pickle
"""
import os
import shutil
import stat
import sys
import tempfile

import _harness as H  # noqa: F401  (sys.path)
import hostile_gen
import hostile_pickle


def _index_seeds():
    wm = lambda f: b'{"weight_map": {"a": "' + f + b'"}'  # noqa: E731
    return {"ok": wm(b"s-1.safetensors") + b"}",
            "dotdot": wm(b"../s-1.safetensors") + b"}",
            "absolute": wm(b"/etc/passwd") + b"}",
            "nul": wm(b"s-1.safetensors\\u0000") + b"}",
            "int_digits": wm(b"s-1.safetensors") + b', "n": ' + hostile_gen.BIG_INT + b"}",
            "deep": wm(b"s-1.safetensors") + b', "d": ' + hostile_gen.deep_json() + b"}"}


def main(out: str) -> None:
    for sub in ("safetensors", "torch_save", "dcp", "pickle"):
        os.makedirs(os.path.join(out, sub), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="metamat_seeds_")
    try:
        bases = hostile_gen.make_bases(os.path.join(tmp, "bases"))
        shutil.copy(bases["st"], os.path.join(out, "safetensors", "valid"))
        shutil.copy(os.path.join(bases["hf"], "m.safetensors.index.json"),
                    os.path.join(out, "safetensors", "index"))
        # index json seeds against the harness's fixed shard s-1.safetensors (tensor "a"):
        # paths leaving the directory, a NUL byte, a 5000-digit int, 5000-deep nesting
        for name, raw in _index_seeds().items():
            H.write(os.path.join(out, "safetensors", f"index_{name}"), raw)
        shutil.copy(bases["ts"], os.path.join(out, "torch_save", "valid"))
        # genuine .metadata / data.pkl and the attacks of tests/hostile_pickle.py
        for name, raw in hostile_pickle.seeds(bases).items():
            H.write(os.path.join(out, "pickle", name), raw)
        # the valid files, and the TORCH_SAVE one shrinking to half while it is opened
        for sel, key, name in ((b"\x00\x00", "dcp", "valid_dcp"),
                               (b"\x01\x00", "dcpst", "valid_dcpst"),
                               (b"\x80\x02", "dcp", "shrinks_dcp")):
            d = bases[key]
            data = [f for f in sorted(os.listdir(d)) if f.endswith(".distcp")][0]
            with open(os.path.join(d, data), "rb") as f:
                H.write(os.path.join(out, "dcp", name), sel + f.read())
        for v in hostile_gen.all_variants():
            if v.base not in ("st", "ts"):
                continue
            w = os.path.join(tmp, v.name)
            os.makedirs(w)
            p = os.path.join(w, os.path.basename(bases[v.base]))
            shutil.copy(bases[v.base], p)
            v.mutate(p)
            if os.path.islink(p) or not stat.S_ISREG(os.stat(p).st_mode):
                continue  # FIFO / device variants: not bytes a harness can take
            sub = "safetensors" if v.base == "st" else "torch_save"
            shutil.copy(p, os.path.join(out, sub, v.name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "fuzz/corpus")
