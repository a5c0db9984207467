"""The dp x pp x tp rank mesh (the placement methods of launcher.config.layout.Layout, which
recipes/gpt/parallel/mesh.py builds the torch DeviceMesh from) and where model pieces go."""
from __future__ import annotations

import itertools

import pytest

from launcher.config.layout import Facts, Layout
from launcher.config.rules import violations
from recipes.gpt.schema import ModelSpec

LAYOUTS = [(1, 1, 2), (1, 2, 1), (2, 1, 2), (1, 2, 2), (2, 2, 2), (3, 2, 4), (2, 4, 1), (4, 1, 1)]


def mesh(dp: int, pp: int, tp: int, procs_per_node: int = 0) -> Layout:
    return Layout(dp=dp, pp=pp, tp=tp, procs_per_node=procs_per_node)


@pytest.mark.timeout(60)
def test_rank_coords_known_values():
    # dp=2 pp=2 tp=2: rank = dp*4 + pp*2 + tp
    assert [mesh(2, 2, 2).coords(r) for r in range(8)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert mesh(dp=1, pp=2, tp=4).coords(5) == (0, 1, 1)
    assert mesh(dp=3, pp=2, tp=2).coords(11) == (2, 1, 1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dp,pp,tp", LAYOUTS)
def test_rank_coords_is_a_bijection_in_row_major_order(dp, pp, tp):
    world = dp * pp * tp
    layout = mesh(dp, pp, tp)
    assert layout.world_size == world
    coords = [layout.coords(r) for r in range(world)]
    # row-major over (dp, pp, tp) == torch.arange(world).view(dp, pp, tp), the DeviceMesh layout
    assert coords == list(itertools.product(range(dp), range(pp), range(tp)))
    assert [layout.rank_of(*c) for c in coords] == list(range(world))


@pytest.mark.timeout(60)
def test_rank_coords_rejects_bad_input():
    with pytest.raises(ValueError, match="outside"):
        mesh(2, 2, 2).coords(8)
    # a mesh size below 1 is refused by the layout rules (no Layout is built from such a config)
    model = ModelSpec(name="m", num_layers=1, hidden_size=8, num_heads=1, ffn_hidden_size=8, vocab_size=8, seq_len=4)
    facts = Facts(nodes=1, gpus_per_node=1, tp=0, pp=1, micro_batch_size=1, global_batch_size=1, model=model)
    assert [e.key for e in violations(facts)] == ["parallelism.tp"]
    assert "must be a positive integer" in str(violations(facts)[0])
    with pytest.raises(ValueError, match="outside mesh"):
        mesh(dp=1, pp=2, tp=1).rank_of(0, 2, 0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dp,pp,tp", LAYOUTS)
def test_groups_partition_the_world(dp, pp, tp):
    world = dp * pp * tp
    layout = mesh(dp, pp, tp)
    g = layout.groups()
    for axis, size, count in (("tp", tp, dp * pp), ("pp", pp, dp * tp), ("dp", dp, pp * tp), ("mp", pp * tp, dp)):
        assert len(g[axis]) == count, axis
        assert all(len(members) == size for members in g[axis]), axis
        assert sorted(r for members in g[axis] for r in members) == list(range(world)), axis
    axis_index = {"dp": 0, "pp": 1, "tp": 2}
    for axis, i in axis_index.items():
        for members in g[axis]:
            cs = [layout.coords(r) for r in members]
            # members differ only along their own axis, and are listed in that axis' order
            assert [c[i] for c in cs] == list(range(len(members)))
            assert len({c[:i] + c[i + 1:] for c in cs}) == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dp,pp,tp", LAYOUTS)
def test_tp_ranks_adjacent_and_embedding_groups(dp, pp, tp):
    layout = mesh(dp, pp, tp)
    g = layout.groups()
    for members in g["tp"]:
        assert members == list(range(members[0], members[0] + tp))
    if pp == 1:
        assert g["embedding"] == []
    else:
        assert len(g["embedding"]) == dp * tp
        for first, last in g["embedding"]:
            (d0, p0, t0), (d1, p1, t1) = layout.coords(first), layout.coords(last)
            assert (d0, t0) == (d1, t1) and (p0, p1) == (0, pp - 1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nodes,per_node,pp,tp", [(2, 2, 2, 2), (2, 4, 2, 4), (4, 2, 2, 2), (2, 8, 2, 2)])
def test_block_placement_keeps_tp_in_a_node_and_spreads_pp(nodes, per_node, pp, tp):
    world = nodes * per_node
    dp = world // (pp * tp)
    layout = mesh(dp, pp, tp, procs_per_node=per_node)
    assert layout.nodes == nodes
    g = layout.groups()
    for members in g["tp"]:
        assert len({layout.node_of(r) for r in members}) == 1
    if tp == per_node:  # a stage fills a node: consecutive stages are tp ranks apart, on different nodes
        for members in g["pp"]:
            assert len({layout.node_of(r) for r in members}) == pp


@pytest.mark.timeout(60)
def test_group_of():
    layout = mesh(2, 2, 2)
    assert layout.group_of(5, "tp") == [4, 5]
    assert layout.group_of(5, "pp") == [5, 7]
    assert layout.group_of(5, "dp") == [1, 5]
    assert layout.group_of(5, "mp") == [4, 5, 6, 7]
    assert layout.group_of(9, "tp") == []


@pytest.mark.timeout(60)
def test_stage_layers_and_head_rows():
    from recipes.gpt.parallel.pipeline import stage_layers
    from recipes.gpt.parallel.tensor_parallel import TPContext, head_rows

    assert [stage_layers(8, 4, s) for s in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert stage_layers(2, 1, 0) == (0, 2)
    with pytest.raises(ValueError, match="outside"):
        stage_layers(8, 4, 4)
    # 4 heads of dim 2, tp=2: rank 1 holds heads 2,3 of q, k and v
    rows = head_rows(4, 2, TPContext(group=None, rank=1, size=2)).tolist()
    assert rows == [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23]
    both = sorted(head_rows(4, 2, TPContext(None, 0, 2)).tolist() + rows)
    assert both == list(range(24))


