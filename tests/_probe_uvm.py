import torch, sys
sys.path.insert(0, ".")
from _quant_models import *
import metamat
from metamat.emulation import emulated_cuda

if __name__ == "__main__":
    tables = ebc_tables(dims=(16, 32, 48), rows=(37, 3, 100))
    f = float_model(tables, seed=11)
    qref = quantize(f, "int8", True)
    for kernel in ("quant_uvm", "quant_uvm_caching"):
        sharder = sharder_for("tw", tables, kernel=kernel)
        plan = quant_plan(qref, sharder, 1, compute_device="cuda")
        got = shard(meta_quant(tables, "int8", True), sharder, plan, 1, "meta", compute_device="cuda")
        torch.save(f.state_dict(), "/tmp/f.pt")
        with emulated_cuda():
            r = metamat.materialize(got, "/tmp/f.pt", device="cuda")
        print(kernel, r.bytes_by_memory)
        for t in tbes(got):
            print(t.weights_physical_placements, t.weights_uvm.shape, t.weights_dev.shape, t.uvm_size, t.max_D_cache, t.total_cache_hash_size)
            for n, b in t.named_buffers():
                if "cache" in n or "lxu" in n:
                    print("  ", n, tuple(b.shape), b.dtype, b.flatten()[:5].tolist())
