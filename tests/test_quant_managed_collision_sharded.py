"""TorchRec's inference sharding of quantized managed-collision collections
(``shard_quant_model`` with ``QuantManagedCollisionEmbedding[Bag]CollectionSharder`` and
``InferManagedCollisionCollectionSharder``, row-wise over 2 ranks in one process) built on meta
and materialized, compared with TorchRec's own sharding of the same model (``sharding_device=
"cpu"``) holding the same values: its tables and global MC modules loaded from TorchRec's
conversion of the trained model, each rank's MC modules from that rank's rows of the training
checkpoint (TorchRec's load hook checks and sorts them). MCH and HashZch, EBC and EC."""
from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torchrec")
pytest.importorskip("fbgemm_gpu")

import metamat  # noqa: E402
from metamat.testing import process_group  # noqa: E402

import _quant_models as qm  # noqa: E402
import test_quant_managed_collision as qmc  # noqa: E402
import test_torchrec_managed_collision as mch  # noqa: E402
from _dist import run_dist  # noqa: E402

WORLD = 2
CPU = torch.device("cpu")
MC_PREFIX = mch.MC_PREFIX  # "_managed_collision_collection._managed_collision_modules."


def _sharder(kind: str):
    """Row-wise inference sharders (TorchRec's row-wise quant sharding keeps scales and biases
    apart from the rows in its state_dict: :func:`_quantize`)."""
    from torchrec.distributed.fused_params import FUSED_PARAM_QUANT_STATE_DICT_SPLIT_SCALE_BIAS
    from torchrec.distributed.mc_modules import InferManagedCollisionCollectionSharder

    fused = {FUSED_PARAM_QUANT_STATE_DICT_SPLIT_SCALE_BIAS: True}
    if kind == "ebc":
        from torchrec.distributed.quant_embeddingbag import (
            QuantEmbeddingBagCollectionSharder, QuantManagedCollisionEmbeddingBagCollectionSharder)

        return QuantManagedCollisionEmbeddingBagCollectionSharder(
            QuantEmbeddingBagCollectionSharder(fused_params=fused),
            InferManagedCollisionCollectionSharder())
    from torchrec.distributed.quant_embedding import (
        QuantEmbeddingCollectionSharder, QuantManagedCollisionEmbeddingCollectionSharder)

    return QuantManagedCollisionEmbeddingCollectionSharder(
        QuantEmbeddingCollectionSharder(fused_params=fused),
        InferManagedCollisionCollectionSharder())


def _shard(qmodel, kind: str, device: str, world_size: int = WORLD,
           compute_device: str = "cpu"):
    """TorchRec's inference sharding, every table row-wise: on ``"meta"`` (what metamat
    materializes) or for real (TorchRec's own: tables zero, MC state fresh until loaded)."""
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.inference.modules import shard_quant_model

    sharder = _sharder(kind)
    plan = construct_module_sharding_plan(
        qmodel.mc, per_param_sharding={t: row_wise(compute_kernel="quant")
                                       for t in ("t0", "t1")},
        local_size=world_size, world_size=world_size, device_type=compute_device,
        sharder=sharder)
    with qm.propagate_device():
        out, _ = shard_quant_model(qmodel, world_size=world_size, compute_device=compute_device,
                                   sharding_device=device, sharders=[sharder],
                                   sharding_plan=ShardingPlan({"mc": plan}))
    return out


def _differs(a, b) -> list:
    """state_dict keys whose blocks differ (sharded tables by their local shards)."""
    sa, sb = qm.state_bytes(a), qm.state_bytes(b)
    return sorted(set(sa) ^ set(sb)) + [
        k for k in sa if k in sb and (len(sa[k]) != len(sb[k]) or any(
            ox != oy or not torch.equal(x, y) for (ox, x), (oy, y) in zip(sa[k], sb[k])))]


def _quantize(model):
    """TorchRec's INT8 conversion, its state_dict keeping scales and biases apart (as the
    sharded model's does: the reference loads one into the other)."""
    from torchrec import EmbeddingBagCollection, EmbeddingCollection
    from torchrec.modules.mc_embedding_modules import (ManagedCollisionEmbeddingBagCollection,
                                                       ManagedCollisionEmbeddingCollection)
    from torchrec.quant.embedding_modules import (
        quant_prep_enable_quant_state_dict_split_scale_bias_for_types as split)

    split(model, [EmbeddingBagCollection, EmbeddingCollection,
                  ManagedCollisionEmbeddingBagCollection, ManagedCollisionEmbeddingCollection])
    return qmc._quantize(model, torch.qint8)


def _on_meta(zch: str, kind: str, **shard_args):
    return _shard(_quantize(qmc.Model(zch, kind, torch.device("meta"))), kind, "meta",
                  **shard_args)


def _rank_modules(model) -> dict:
    """(rank, table) -> that rank's MC module of the table, and its (first row, rows)."""
    smcc = model.mc._managed_collision_collection
    return {(r, t): (m, smcc._shard_metadata_per_rank[r][t])
            for r, mcs in enumerate(smcc._managed_collision_modules_per_rank)
            for t, m in mcs.items()}


def _device(d) -> torch.device:
    """``d`` with the current GPU's index where it names none (TorchRec may keep "cuda")."""
    d = torch.device(d)
    if d.type == "cuda" and d.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return d


def _rank_state_differs(model, ref) -> list:
    """What of each rank's MC modules differs from TorchRec's, beyond the state_dict: every
    buffer (``_mch_slots``, ``_delimiter`` are not saved), the output offset, the row
    boundaries' alias TorchRec's load hook restores, the device."""
    bad = []
    ours, theirs = _rank_modules(model), _rank_modules(ref)
    assert ours.keys() == theirs.keys()
    for key, (m, _) in ours.items():
        r = theirs[key][0]
        a, b = dict(m.named_buffers()), dict(r.named_buffers())
        bad += [(key, n) for n in sorted(set(a) | set(b))
                if n not in a or n not in b or not torch.equal(a[n], b[n])]
        if hasattr(r, "_init_output_segments_tensor"):  # MCH
            if m._init_output_segments_tensor is not m._output_segments_tensor:
                bad.append((key, "_init_output_segments_tensor"))
        off, want = getattr(m, "_output_global_offset_tensor", None), \
            getattr(r, "_output_global_offset_tensor", None)
        if (off is None) != (want is None) or (off is not None and not torch.equal(off, want)):
            bad.append((key, "_output_global_offset_tensor"))
        if _device(m._device) != _device(r._device):
            bad.append((key, "_device"))
    return bad


def _forward(kind: str, model, batch) -> torch.Tensor:
    with qm.propagate_device():
        return mch._output(kind, model.mc(batch))


def _batch(zch: str, seed: int = 400):
    return mch._batch(seed, hash_size=qmc.KINDS[zch].HASH)


def worker_training(rank, world_size, tmp, zch, kind, name, bump):
    """A training DMP (row-wise) whose trained state DCP saves; ``bump`` makes a newer one
    (other tables, other eviction metadata)."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(bump)
    eager = qmc.KINDS[zch]._eager(kind, world_size)
    if zch == "mch":
        mch._trained_mc_state(eager, rank, world_size)
    else:
        qmc.hz._trained_slots(eager, rank, world_size)
    with torch.no_grad():
        for key, v in eager.state_dict().items():
            if bump and key.endswith(("_mch_counts", "_mch_last_access_iter",
                                      "_hash_zch_runtime_meta")):
                for s in v.local_shards():
                    s.tensor.add_(bump)
    # the serving model holds the collection as ``mc``
    dcp.save({f"mc.{k}": v for k, v in eager.state_dict().items()},
             checkpoint_id=os.path.join(tmp, name))
    dist.barrier()
    return True


def _training_checkpoint(tmp, zch: str, kind: str, name: str = "ckpt", bump: int = 0) -> str:
    run_dist(worker_training, WORLD, str(tmp), zch, kind, name, bump)
    return str(tmp / name)


def _torchrec_reference(zch: str, kind: str, ckpt: str, world_size: int = WORLD,
                        device: str = "cpu"):
    """(TorchRec's conversion of the trained model, unsharded; TorchRec's sharding of it on
    ``device``) holding the checkpoint's values as the module docstring says."""
    import torch.distributed.checkpoint as dcp

    float_model = qmc.Model(zch, kind, CPU)
    sd = float_model.state_dict()
    dcp.load(sd, checkpoint_id=ckpt)
    float_model.load_state_dict(sd)
    unsharded = _quantize(float_model)
    ref = _shard(copy.deepcopy(unsharded), kind, device, world_size=world_size,
                 compute_device=device)
    ref.load_state_dict(unsharded.state_dict(), strict=False)  # tables, global MC modules
    saved = {k: v.clone() for k, v in qmc.Model(zch, kind, CPU).state_dict().items()
             if MC_PREFIX in k}
    dcp.load(saved, checkpoint_id=ckpt)
    for (_, table), (m, (first, rows)) in _rank_modules(ref).items():
        whole = {k[len(f"mc.{MC_PREFIX}{table}."):]: v for k, v in saved.items()
                 if k.startswith(f"mc.{MC_PREFIX}{table}.")}
        m.load_state_dict({k: whole[k][first:first + rows] if v.shape != whole[k].shape
                           else whole[k] for k, v in m.state_dict().items()})
    return unsharded, ref


def _seen_ids_batch(zch: str, kind: str, unsharded):
    """A batch of ids the training saw (each in a slot): every id remaps to the same row
    sharded or not. MCH: TorchRec's inference input dist sends an id to the rank of the rows
    it falls in (t1: 68 rows split at 34), the training one to the rank of its block of raw
    ids (split at 32, as ``_trained_mc_state`` writes): ids 32 and 33 of t1 reach a rank that
    never saw them, and are left out."""
    from torchrec import KeyedJaggedTensor

    ids = []
    for i, t in enumerate(("t0", "t1")):
        mc = unsharded.mc._managed_collision_collection._managed_collision_modules[t]
        held = (mc._mch_sorted_raw_ids if zch == "mch" else mc._hash_zch_identities).flatten()
        held = held[(held >= 0) & (held < qmc.KINDS[zch].HASH)]
        if zch == "mch":
            rows = mch.ROWS[i]
            held = held[held * WORLD // mch.HASH == held * WORLD // rows]
        ids.append(held[torch.randperm(held.numel(), generator=torch.Generator().manual_seed(
            len(ids)))[:12]])
    lengths = torch.tensor([2] * 6 + [2] * 6)
    return KeyedJaggedTensor.from_lengths_sync(keys=["f0", "f1"], values=torch.cat(ids),
                                               lengths=lengths)


@pytest.mark.multiprocess
@pytest.mark.parametrize("zch", ["mch", "hash"])
@pytest.mark.parametrize("kind", ["ebc", "ec"])
def test_training_checkpoint_like_torchrecs_own_sharding(zch, kind, tmp_path):
    """A world-2 training checkpoint into the sharded quantized model on meta: every table
    byte, every global and per-rank MC tensor and the lookups equal TorchRec's sharding
    holding the same values; ids the training saw give the unsharded model's embeddings."""
    ckpt = _training_checkpoint(tmp_path, zch, kind)
    with process_group():
        unsharded, ref = _torchrec_reference(zch, kind, ckpt)
        model = _on_meta(zch, kind)
        report = metamat.materialize(model, ckpt, device="cpu")
        assert report.unexpected == []
        assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
        assert _differs(model, ref) == [] and _rank_state_differs(model, ref) == []
        batch = _batch(zch)
        assert torch.equal(_forward(kind, model, batch), _forward(kind, ref, batch))
        seen = _seen_ids_batch(zch, kind, unsharded)
        want = mch._output(kind, unsharded.mc(seen))
        torch.testing.assert_close(_forward(kind, model, seen), want)


@pytest.mark.parametrize("zch", ["mch", "hash"])
@pytest.mark.parametrize("kind", ["ebc", "ec"])
def test_init_like_torchrecs_own_sharding(zch, kind):
    """No checkpoint: the tables are the unsharded model's init (plan invariant), the global
    MC modules TorchRec's initial state, each rank's the state TorchRec builds for its rows."""
    with process_group():
        unsharded = _quantize(qmc.Model(zch, kind, torch.device("meta")))
        metamat.materialize(unsharded, seed=3, device="cpu")
        ref = _shard(copy.deepcopy(unsharded), kind, "cpu")
        ref.load_state_dict(unsharded.state_dict(), strict=False)  # ranks: TorchRec's own
        model = _on_meta(zch, kind)
        metamat.materialize(model, seed=3, device="cpu")
        assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
        assert _differs(model, ref) == [] and _rank_state_differs(model, ref) == []
        batch = _batch(zch)
        assert torch.equal(_forward(kind, model, batch), _forward(kind, ref, batch))


@pytest.mark.multiprocess
@pytest.mark.parametrize("zch", ["mch", "hash"])
def test_the_served_models_own_checkpoint_loads_back(zch, tmp_path):
    """The sharded model's own state_dict saved by DCP (each rank's MC modules and its views
    of the tables under their own names; the global MCH modules sorted as one table) into the
    model on meta: each rank reads its own modules' state; the same state and lookups."""
    import torch.distributed.checkpoint as dcp

    ckpt = _training_checkpoint(tmp_path, zch, "ebc")
    with process_group():
        served = _on_meta(zch, "ebc")
        metamat.materialize(served, ckpt, device="cpu")
        dcp.save(served.state_dict(), checkpoint_id=str(tmp_path / "own"))
        model = _on_meta(zch, "ebc")
        report = metamat.materialize(model, str(tmp_path / "own"), device="cpu")
        assert report.unexpected == [] and report.initialized == []
        assert any("._mcc_remapper.zchs." in n for n in report.loaded)
        assert _differs(model, served) == [] and _rank_state_differs(model, served) == []
        batch = _batch(zch)
        assert torch.equal(_forward("ebc", model, batch), _forward("ebc", served, batch))


def _still_on_meta(model) -> bool:
    return all(t.is_meta for n, t in model.state_dict().items()
               if ("zchs" in n or MC_PREFIX in n) and isinstance(t, torch.Tensor)
               and not n.endswith("_hash_zch_bucket"))


def test_checkpoint_of_another_split_is_refused_and_the_model_stays_on_meta(tmp_path):
    """An unsharded training checkpoint (one run of slots for all rows): no rank's rows are a
    union of its shards, which TorchRec's MC modules cannot reshard; named, nothing changed."""
    import torch.distributed.checkpoint as dcp

    with process_group():
        dcp.save(qmc._trained("mch", "ebc", seed=1).state_dict(),
                 checkpoint_id=str(tmp_path / "ckpt"))
        model = _on_meta("mch", "ebc")
        with pytest.raises(metamat.UnsupportedError, match=r"_output_segments_tensor: the "
                           r"checkpoint's managed-collision rows of table 't0' are split at "
                           r"\[0, 64\]"):
            metamat.materialize(model, str(tmp_path / "ckpt"), device="cpu")
        assert _still_on_meta(model)


@pytest.mark.multiprocess
def test_state_sorted_as_one_table_is_refused(tmp_path):
    """A model that sorted a sharded checkpoint's slots as one table (an unsharded one loaded
    from it) maps ids of one rank's rows to another's: refused, naming the table, rather than
    served with ids remapped out of the rank's rows."""
    ckpt = _training_checkpoint(tmp_path, "mch", "ebc")
    with process_group():
        unsharded, _ = _torchrec_reference("mch", "ebc", ckpt)
        torch.save({k: v.clone() for k, v in unsharded.state_dict().items()},
                   tmp_path / "unsharded.pt")
        model = _on_meta("mch", "ebc")
        with pytest.raises(metamat.UnsupportedError, match=r"_mch_remapped_ids_mapping: the "
                           r"checkpoint's slots of rows \[0, 32\) of table 't0' remap"):
            metamat.materialize(model, str(tmp_path / "unsharded.pt"), device="cpu")
        assert _still_on_meta(model)


def worker_dmp_refuses(rank, world_size, ckpt):
    """A training DMP on meta (row-wise, 2 ranks) refuses the state sorted as one table."""
    model = mch._on_meta("ebc", world_size)
    with pytest.raises(metamat.UnsupportedError, match=r"_mch_remapped_ids_mapping: the "
                       r"checkpoint's slots of rows \[(0, 32|32, 64)\) of table 't0' remap"):
        metamat.materialize(model, ckpt)
    return all(t.is_meta for t in model.parameters())


@pytest.mark.multiprocess
def test_state_sorted_as_one_table_is_refused_by_a_training_dmp_too(tmp_path):
    """The same check on TorchRec's training sharding: each rank's slots must remap into its
    own rows; the model stays on meta."""
    import torch.distributed.checkpoint as dcp

    ckpt = _training_checkpoint(tmp_path, "mch", "ebc")
    with process_group():
        float_model = qmc.Model("mch", "ebc", CPU)
        sd = float_model.state_dict()
        dcp.load(sd, checkpoint_id=ckpt)
        float_model.load_state_dict(sd)  # TorchRec's load hook sorts the slots as one table
        dcp.save(float_model.mc.state_dict(), checkpoint_id=str(tmp_path / "sorted"))
    assert run_dist(worker_dmp_refuses, WORLD, str(tmp_path / "sorted")) == [True, True]


@pytest.mark.multiprocess
@pytest.mark.parametrize("zch", ["mch", "hash"])
def test_live_model_refreshed_from_a_newer_checkpoint(zch, tmp_path):
    """A materialized sharded model refreshed from a newer training checkpoint: its tables and
    every MC module equal TorchRec's sharding holding the newer values."""
    first = _training_checkpoint(tmp_path, zch, "ebc")
    newer = _training_checkpoint(tmp_path, zch, "ebc", name="newer", bump=5)
    with process_group():
        model = _on_meta(zch, "ebc")
        metamat.materialize(model, first, device="cpu")
        report = metamat.materialize(model, newer, device="cpu")
        _, ref = _torchrec_reference(zch, "ebc", newer)
        assert report.unexpected == [] and _differs(model, ref) == []
        batch = _batch(zch)
        assert torch.equal(_forward("ebc", model, batch), _forward("ebc", ref, batch))


@pytest.mark.multiprocess
@pytest.mark.parametrize("zch", ["mch", "hash"])
def test_for_a_gpu_on_the_emulated_device(zch, tmp_path):
    """Sharded for a GPU (one rank, ``compute_device="cuda"``): CUDA inference TBEs and the MC
    state on the device, the same state_dict as the model sharded for the CPU (the emulated
    device: CPU memory standing in)."""
    from metamat.emulation import emulated_cuda

    ckpt = _training_checkpoint(tmp_path, zch, "ebc")
    with process_group():
        on_cpu = _on_meta(zch, "ebc", world_size=1)
        metamat.materialize(on_cpu, ckpt, device="cpu")
        with emulated_cuda():
            model = _on_meta(zch, "ebc", world_size=1, compute_device="cuda")
            report = metamat.materialize(model, ckpt, device="cuda")
    assert "emulated" in report.device and report.unexpected == []
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert _differs(model, on_cpu) == []


@pytest.mark.cuda
@pytest.mark.multiprocess
@pytest.mark.parametrize("zch,kind", [("mch", "ebc"), ("hash", "ec")])
def test_on_a_gpu_like_torchrecs_own_sharding_on_the_gpu(zch, kind, tmp_path):
    """Sharded for the GPU (one rank): tables, MC state and lookups equal TorchRec's own
    sharding on the GPU holding the same values (two of the four kinds: the GPU check's time
    is short; the CPU tests cover all four)."""
    ckpt = _training_checkpoint(tmp_path, zch, kind)
    gpu = torch.device("cuda", 0)
    with process_group():
        unsharded, ref = _torchrec_reference(zch, kind, ckpt, world_size=1, device="cuda")
        model = _on_meta(zch, kind, world_size=1, compute_device="cuda")
        report = metamat.materialize(model, ckpt, device="cuda:0")
        assert report.unexpected == []
        assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
        # the state_dict, and each rank's MC modules beyond it (unsaved buffers, offsets,
        # the device their remapping runs on)
        assert _differs(model, ref) == [] and _rank_state_differs(model, ref) == []
        batch = _batch(zch).to(gpu)
        assert torch.equal(_forward(kind, model, batch), _forward(kind, ref, batch))
        seen = _seen_ids_batch(zch, kind, unsharded).to(gpu)  # remapped to trained slots
        assert torch.equal(_forward(kind, model, seen), _forward(kind, ref, seen))


@pytest.mark.multiprocess
@pytest.mark.parametrize("zch", ["mch", "hash"])
def test_torchrecs_own_served_model_takes_a_training_checkpoint(zch, tmp_path):
    """A serving model TorchRec sharded for real (tables of other values, each rank's MC
    modules fresh: TorchRec has no path that fills them) refreshed from a training
    checkpoint: the state TorchRec's sharding holds with that checkpoint's values."""
    ckpt = _training_checkpoint(tmp_path, zch, "ebc")
    with process_group():
        _, ref = _torchrec_reference(zch, "ebc", ckpt)
        other = _quantize(qmc._trained(zch, "ebc", seed=9))
        served = _shard(copy.deepcopy(other), "ebc", "cpu")
        served.load_state_dict(other.state_dict(), strict=False)
        report = metamat.materialize(served, ckpt, device="cpu")
        assert report.unexpected == []
        assert _differs(served, ref) == [] and _rank_state_differs(served, ref) == []
        batch = _batch(zch)
        assert torch.equal(_forward("ebc", served, batch), _forward("ebc", ref, batch))
