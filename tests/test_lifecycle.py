"""The block state machine: legal paths work, every illegal transition raises."""

import pytest

from sglang_kvbm.core.lifecycle import Block, BlockState, BlockStateError
from sglang_kvbm.core.ports import BlockMeta


def block() -> Block:
    return Block(BlockMeta("ab" * 32, (1, 2, 3, 4)))


def test_full_lifecycle():
    b = block()
    assert b.state is BlockState.MUTABLE
    b.commit()
    b.register()
    assert b.state is BlockState.REGISTERED
    b.drop()
    assert b.state is BlockState.DROPPED


@pytest.mark.parametrize("steps", [[], ["commit"]])
def test_drop_before_register_is_allowed(steps):
    b = block()
    for step in steps:
        getattr(b, step)()
    b.drop()
    assert b.state is BlockState.DROPPED


@pytest.mark.parametrize(
    "steps, illegal",
    [
        ([], "register"),  # register before commit
        (["commit"], "commit"),  # commit twice
        (["commit", "register"], "commit"),
        (["commit", "register"], "register"),
        (["drop"], "commit"),
        (["drop"], "register"),
        (["drop"], "drop"),
        (["commit", "register", "drop"], "drop"),
    ],
)
def test_illegal_transitions_raise(steps, illegal):
    b = block()
    for step in steps:
        getattr(b, step)()
    before = b.state
    with pytest.raises(BlockStateError):
        getattr(b, illegal)()
    assert b.state is before
