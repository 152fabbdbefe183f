"""One launch of each fbgemm-gpu CUDA kernel family that TorchRec training and metamat's tests
use, each checked against a host reference: tells within seconds whether the carried stack
(scripts/gpu_torchrec_stack.sh keeps only some sm_90a cubins) runs on this GPU, and which
family does not ("no kernel image is available" names a dropped cubin; see
.gpu/stack/DROPPED.tsv).

    PYTHONPATH=/tmp/site python3 scripts/gpu_fbgemm_smoke.py            # cuda
    python3 scripts/gpu_fbgemm_smoke.py --device cpu    # the same code on fbgemm's CPU ops

Prints one line per check (ok / FAIL / skip and why) and exits 1 if any check failed.
"""
from __future__ import annotations

import argparse
import sys
import traceback

import torch

RESULTS = []


def check(name):
    def wrap(fn):
        RESULTS.append((name, fn))
        return fn
    return wrap


class Skip(Exception):
    pass


def _bags(tables, rows, batch, gen, device):
    """indices/offsets of ``batch`` bags per table (0-3 rows each), table-major."""
    lengths = torch.randint(0, 4, (tables * batch,), generator=gen)
    indices = torch.cat([torch.randint(0, rows, (int(n),), generator=gen) for n in lengths]
                        or [torch.zeros(0, dtype=torch.int64)])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    return indices.to(device), offsets.to(device)


def _tbe(ctx, optimizer, location="DEVICE", pooling="SUM", cache="LRU", weighted=False,
         dense=False):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (CacheAlgorithm,
                                                                      EmbeddingLocation,
                                                                      PoolingMode)
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice, DenseTableBatchedEmbeddingBagsCodegen,
        SplitTableBatchedEmbeddingBagsCodegen)

    dev = ctx.device
    if dev.type == "cpu" and optimizer == "ADAM":
        raise Skip("fbgemm has no CPU Adam")
    T, rows, dims, B = 2, 50, [8, 16], 6
    pool = PoolingMode[pooling]
    if dense:
        tbe = DenseTableBatchedEmbeddingBagsCodegen([(rows, d) for d in dims], pooling_mode=pool,
                                                    use_cpu=dev.type == "cpu")
        weights = [w.detach().clone().cpu() for w in tbe.split_embedding_weights()]
    else:
        if dev.type == "cpu":
            loc, cd = EmbeddingLocation.HOST, ComputeDevice.CPU
        else:
            loc, cd = EmbeddingLocation[location], ComputeDevice.CUDA
        if pool == PoolingMode.NONE:
            dims = [8, 8]
        kw = dict(cache_algorithm=CacheAlgorithm[cache]) if location == "MANAGED_CACHING" else {}
        tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [(rows, d, loc, cd) for d in dims], optimizer=EmbOptimType[optimizer],
            learning_rate=0.1, pooling_mode=pool, device=dev, **kw)
        with torch.no_grad():
            for w in tbe.split_embedding_weights():
                w.copy_(torch.randn(w.shape, generator=ctx.gen).to(w.dtype))
        weights = [w.detach().clone().cpu() for w in tbe.split_embedding_weights()]
    indices, offsets = _bags(T, rows, B, ctx.gen, dev)
    psw = torch.rand(indices.numel(), generator=ctx.gen).to(dev) if weighted else None
    out = tbe(indices, offsets, per_sample_weights=psw) if weighted else tbe(indices, offsets)
    # the host reference of the forward
    ic, oc = indices.cpu(), offsets.cpu()
    wc = psw.cpu() if weighted else None
    if pool == PoolingMode.NONE:
        want = torch.cat([weights[t][ic[oc[t * B]:oc[(t + 1) * B]]] for t in range(T)])
    else:
        cols = []
        for t in range(T):
            bag = []
            for b in range(B):
                s, e = int(oc[t * B + b]), int(oc[t * B + b + 1])
                rowsel = weights[t][ic[s:e]]
                if weighted:
                    rowsel = rowsel * wc[s:e, None]
                v = rowsel.sum(0)
                if pool == PoolingMode.MEAN and e > s:
                    v = v / (e - s)
                bag.append(v)
            cols.append(torch.stack(bag))
        want = torch.cat(cols, dim=1)
    assert torch.allclose(out.detach().float().cpu(), want, atol=1e-4), "forward differs"
    out.sum().backward()  # fused optimizers update in backward
    if dense:
        grads = [p.grad for p in tbe.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads), "no dense gradient"
    else:
        if location == "MANAGED_CACHING" and dev.type == "cuda":
            tbe.flush()  # lxu_cache_flush: the cache's updated rows back into UVM
            torch.cuda.synchronize()
        after = [w.detach().cpu() for w in tbe.split_embedding_weights()]
        touched = [ic[oc[t * B]:oc[(t + 1) * B]].unique() for t in range(T)]
        changed = any(not torch.equal(after[t][touched[t]], weights[t][touched[t]])
                      for t in range(T) if touched[t].numel())
        assert changed, "the fused optimizer step changed no row"
    return tbe


for _opt in ("EXACT_ROWWISE_ADAGRAD", "EXACT_ADAGRAD", "EXACT_SGD", "ADAM"):
    check(f"tbe {_opt} DEVICE sum")(lambda ctx, o=_opt: _tbe(ctx, o))
check("tbe EXACT_ROWWISE_ADAGRAD DEVICE weighted")(
    lambda ctx: _tbe(ctx, "EXACT_ROWWISE_ADAGRAD", weighted=True))
check("tbe EXACT_ROWWISE_ADAGRAD DEVICE mean")(
    lambda ctx: _tbe(ctx, "EXACT_ROWWISE_ADAGRAD", pooling="MEAN"))
check("tbe EXACT_ROWWISE_ADAGRAD DEVICE nobag")(
    lambda ctx: _tbe(ctx, "EXACT_ROWWISE_ADAGRAD", pooling="NONE"))
check("tbe EXACT_SGD DEVICE nobag")(lambda ctx: _tbe(ctx, "EXACT_SGD", pooling="NONE"))
check("tbe EXACT_ROWWISE_ADAGRAD MANAGED")(
    lambda ctx: ctx.cuda_only() or _tbe(ctx, "EXACT_ROWWISE_ADAGRAD", location="MANAGED"))
check("tbe EXACT_ROWWISE_ADAGRAD MANAGED_CACHING LRU (+flush)")(
    lambda ctx: ctx.cuda_only() or _tbe(ctx, "EXACT_ROWWISE_ADAGRAD", location="MANAGED_CACHING"))
check("tbe EXACT_ROWWISE_ADAGRAD MANAGED_CACHING LFU (+flush)")(
    lambda ctx: ctx.cuda_only() or _tbe(ctx, "EXACT_ROWWISE_ADAGRAD", location="MANAGED_CACHING",
                                        cache="LFU"))
check("tbe ADAM MANAGED_CACHING LRU nobag")(
    lambda ctx: ctx.cuda_only() or _tbe(ctx, "ADAM", location="MANAGED_CACHING",
                                        pooling="NONE"))
check("dense tbe (DenseTableBatchedEmbeddingBagsCodegen) sum")(lambda ctx: _tbe(ctx, None, dense=True))


def _inference(ctx, dtype):
    """fbgemm's inference TBE (TorchRec's quantized modules): the device's forward against
    the same rows on the host."""
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import (
        IntNBitTableBatchedEmbeddingBagsCodegen as Q)

    def specs(loc):
        return [("t0", 50, 16, SparseType[dtype], loc), ("t1", 50, 32, SparseType[dtype], loc)]

    cpu = Q(specs(EmbeddingLocation.HOST), device="cpu", row_alignment=16)  # the device's
    cpu.fill_random_weights()
    if dtype == "FP16":  # random bytes are not all finite halves
        for w, _ in cpu.split_embedding_weights():
            w.view(torch.float16).copy_(torch.randn(w.shape[0], w.shape[1] // 2, generator=ctx.gen))
    dev = ctx.device
    if dev.type == "cpu":
        dut = cpu
    else:
        dut = Q(specs(EmbeddingLocation.DEVICE), device=dev, row_alignment=16)
        dut.fill_random_weights()
        for (wd, sd), (wc, sc) in zip(dut.split_embedding_weights(), cpu.split_embedding_weights()):
            wd.copy_(wc)
            if sd is not None:
                sd.copy_(sc)
    indices, offsets = _bags(2, 50, 6, ctx.gen, "cpu")
    want = cpu(indices.int(), offsets.int()).float()
    got = dut(indices.int().to(dev), offsets.int().to(dev)).float().cpu()
    assert torch.allclose(got, want, rtol=1e-2, atol=1e-2), "forward differs from the host's"


for _dt in ("INT8", "INT4", "INT2", "FP16"):
    check(f"inference tbe {_dt} DEVICE (IntNBitTableBatchedEmbeddingBagsCodegen)")(
        lambda ctx, d=_dt: _inference(ctx, d))


@check("uvm: new_unified_tensor, is_uvm_tensor, uvm_to_cpu (managed; host-mapped from 1.8)")
def _uvm(ctx):
    ctx.cuda_only()
    import fbgemm_gpu

    # fbgemm < 1.8's uvm_to_cpu reads managed memory only (host-mapped: "Expected tcontext !=
    # nullptr"; fixed by fbgemm #5816): metamat makes its own host view there (allocate.py)
    major_minor = tuple(int(x) for x in fbgemm_gpu.__version__.split(".")[:2])
    for mapped in (False, True):
        t = torch.ops.fbgemm.new_unified_tensor(torch.zeros(1, device=ctx.device), [64, 8], mapped)
        t.fill_(3.0)
        torch.cuda.synchronize()
        assert torch.ops.fbgemm.is_uvm_tensor(t)
        if mapped and major_minor < (1, 8):
            try:
                torch.ops.fbgemm.uvm_to_cpu(t)
            except RuntimeError:
                continue
            raise AssertionError("uvm_to_cpu gave a host-mapped tensor a view before 1.8")
        c = torch.ops.fbgemm.uvm_to_cpu(t)
        assert c.device.type == "cpu" and float(c.sum()) == 3.0 * 64 * 8


@check("asynchronous_complete_cumsum")
def _cumsum(ctx):
    x = torch.tensor([1, 2, 0, 4], device=ctx.device)
    got = torch.ops.fbgemm.asynchronous_complete_cumsum(x).cpu().tolist()
    assert got == [0, 1, 3, 3, 7], got


@check("permute_2D_sparse_data")
def _permute(ctx):
    d = ctx.device
    lengths = torch.tensor([[1, 2], [0, 1]], device=d)  # 2 features x 2 batches
    values = torch.tensor([10, 11, 12, 13], device=d)
    permute = torch.tensor([1, 0], dtype=torch.int32, device=d)
    pl, pv, _ = torch.ops.fbgemm.permute_2D_sparse_data(permute, lengths, values, None, None)
    assert pl.cpu().tolist() == [[0, 1], [1, 2]] and pv.cpu().tolist() == [13, 10, 11, 12]


@check("block_bucketize_sparse_features")
def _bucketize(ctx):
    d = ctx.device
    lengths = torch.tensor([2, 1], device=d)
    indices = torch.tensor([0, 5, 7], device=d)
    block = torch.tensor([4], device=d)
    out = torch.ops.fbgemm.block_bucketize_sparse_features(lengths, indices, False, False,
                                                           block, 2, None)
    assert out[0].cpu().tolist() == [1, 0, 1, 1], out[0]
    assert out[1].cpu().tolist() == [0, 1, 3], out[1]


@check("jagged_to_padded_dense, dense_to_jagged")
def _jagged(ctx):
    d = ctx.device
    values = torch.arange(6, dtype=torch.float32, device=d).view(3, 2)
    offsets = torch.tensor([0, 1, 3], device=d)
    dense = torch.ops.fbgemm.jagged_to_padded_dense(values, [offsets], [2], 0.0)
    assert dense.shape == (2, 2, 2) and float(dense[0, 1].abs().sum()) == 0.0
    back = torch.ops.fbgemm.dense_to_jagged(dense, [offsets])[0]
    assert torch.equal(back.cpu(), values.cpu())


@check("permute_pooled_embs_auto_grad (KeyedTensor regroup)")
def _ppe(ctx):
    d = ctx.device
    emb = torch.arange(12, dtype=torch.float32, device=d).view(2, 6).requires_grad_()
    offs = torch.tensor([0, 2, 6], device=d)
    perm = torch.tensor([1, 0], device=d)
    inv_offs = torch.tensor([0, 4, 6], device=d)
    out = torch.ops.fbgemm.permute_pooled_embs_auto_grad(emb, offs, perm, inv_offs, perm)
    assert out[0].cpu().tolist() == [2, 3, 4, 5, 0, 1], out
    out.sum().backward()


@check("bounds_check_indices")
def _bounds(ctx):
    d = ctx.device
    rows = torch.tensor([10, 10], device=d)
    indices = torch.tensor([1, 2, 3], device=d)
    offsets = torch.tensor([0, 1, 2, 3, 3], device=d)
    warning = torch.zeros(1, dtype=torch.int64, device=d)
    torch.ops.fbgemm.bounds_check_indices(rows, indices, offsets, 1, warning, None)
    assert int(warning.item()) == 0


@check("zero_collision_hash: insert, then a read-only lookup (TorchRec's HashZch)")
def _zch(ctx):
    ctx.cuda_only()  # the CPU op only looks ids up (readonly)
    d = ctx.device
    identities, _ = torch.ops.fbgemm.create_zch_buffer(200, device=d)
    ids = torch.arange(100, 200, dtype=torch.int64, device=d)
    sizes, offsets = torch.full_like(ids, 100), torch.zeros_like(ids)
    slots, _ = torch.ops.fbgemm.zero_collision_hash(
        input=ids, identities=identities, max_probe=100, circular_probe=True,
        local_sizes=sizes, offsets=offsets)
    assert sorted(slots.cpu().tolist()) == list(range(100)), "not one slot per new id"
    again, _ = torch.ops.fbgemm.zero_collision_hash(
        input=ids, identities=identities, max_probe=100, circular_probe=True, readonly=True,
        local_sizes=sizes, offsets=offsets)
    assert torch.equal(again, slots), "a read-only lookup found other slots"


@check("reset_weight_momentum (TorchRec's MC eviction of rows)")
def _reset_rows(ctx):
    ctx.cuda_only()  # no CPU kernel
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen)

    d = ctx.device
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(10, 8, EmbeddingLocation.DEVICE, ComputeDevice.CUDA)] * 2,
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, device=d)
    with torch.no_grad():
        tbe.weights_dev.copy_(torch.randn(tbe.weights_dev.shape, generator=ctx.gen).to(d))
        tbe.momentum1_dev.fill_(2.0)
    before = [w.detach().cpu().clone() for w in tbe.split_embedding_weights()]
    reset = {0: [1, 3], 1: [2]}  # rows per table
    tbe.reset_embedding_weight_momentum(
        pruned_indices=torch.tensor(reset[0] + reset[1], dtype=torch.int64),
        pruned_indices_offsets=torch.tensor([0, 2, 3], dtype=torch.int64),
        logical_table_ids=torch.tensor([0, 1], dtype=torch.int32),
        buffer_ids=torch.tensor([0, 1], dtype=torch.int32))
    after = [w.detach().cpu() for w in tbe.split_embedding_weights()]
    momentum = tbe.momentum1_dev.cpu().view(2, 10)
    for t, rows in reset.items():
        keep = [r for r in range(10) if r not in rows]
        assert float(after[t][rows].abs().sum()) == 0.0, f"table {t}: rows not reset"
        assert torch.equal(after[t][keep], before[t][keep]), f"table {t}: other rows changed"
        assert float(momentum[t, rows].abs().sum()) == 0.0, f"table {t}: momentum not reset"
        assert bool((momentum[t, keep] == 2.0).all()), f"table {t}: other momentum changed"


class Ctx:
    def __init__(self, device):
        self.device = device
        self.gen = torch.Generator().manual_seed(0)

    def cuda_only(self):
        if self.device.type != "cuda":
            raise Skip("CUDA only")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device visible to torch")
        return 1
    import fbgemm_gpu

    print(f"fbgemm_gpu {fbgemm_gpu.__version__} from {fbgemm_gpu.__file__}; torch "
          f"{torch.__version__}; device {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""))
    failed = skipped = 0
    for name, fn in RESULTS:
        ctx = Ctx(device)
        try:
            fn(ctx)
            if device.type == "cuda":
                torch.cuda.synchronize()
            print(f"ok    {name}")
        except Skip as e:
            skipped += 1
            print(f"skip  {name}: {e}")
        except Exception as e:  # noqa: BLE001 - every failure is reported, the rest still run
            failed += 1
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            print(f"FAIL  {name}: {type(e).__name__}: {msg[:300]}")
            traceback.print_exc(limit=3, file=sys.stdout)
            if device.type == "cuda" and "illegal" in str(e).lower():
                print("  (the CUDA context is lost: the checks after this one are void)")
    print(f"{len(RESULTS) - failed - skipped} of {len(RESULTS)} checks ok, {skipped} skipped"
          if not failed else f"{failed} of {len(RESULTS)} checks FAILED")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
