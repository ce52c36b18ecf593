"""The fork server's seccomp filter builder (the filter's effect is tested end to end in test_hazards)."""

from __future__ import annotations

import struct

import pytest

from agentrl.sandboxes._forkserver import seccomp_filter


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_filter_is_well_formed_on_every_supported_architecture(machine: str) -> None:
    code = seccomp_filter([1234, 77], [1234], machine)
    insns = [struct.unpack("<HBBI", code[i:i + 8]) for i in range(0, len(code), 8)]
    assert len(code) % 8 == 0 and len(insns) < 4096  # BPF_MAXINSNS
    deny = (0x06, 0, 0, 0x00050001)  # ret SECCOMP_RET_ERRNO | EPERM
    assert insns[-1] == deny and insns[2] == deny  # the last instruction; and a foreign ABI
    for pc, (code_, jt, jf, _) in enumerate(insns):
        if code_ & 0x07 == 0x05:  # BPF_JMP: both targets stay inside the program
            assert pc + 1 + max(jt, jf) < len(insns)
    values = {k for code_, _, _, k in insns if code_ == 0x15}
    assert {1234, 77, 0xFFFFFFFF, (-1234) & 0xFFFFFFFF} <= values  # the server, its parent, kill(-1), its group


def test_unknown_architecture_is_refused_with_the_supported_ones() -> None:
    with pytest.raises(RuntimeError, match=r"riscv64.*aarch64.*x86_64"):
        seccomp_filter([1], [1], "riscv64")
