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


def test_the_servers_json_and_base64_are_the_stdlibs() -> None:
    """The fork/workspace servers frame with _json and binascii (no json, base64: they import re)."""
    import base64
    import json

    from agentrl.sandboxes._forkserver import b64decode, b64encode, json_dumps, json_loads

    values = [
        {"op": "exec", "cmd": "echo 'h\u00e9llo' \"$X\"\n", "stdin": "", "timeout": 30.0, "max_out": 65536,
         "cwd": None, "env": {"PATH": "/usr/bin", "LANG": "C.UTF-8"}},
        {"exit_code": -9, "timed_out": True, "wall": 0.1234567890123, "big": 2**70, "neg": -0.0},
        {"nested": [[], {}, [1, [2, [3]]], "\x00\x1f\u2028\udcff\U0001f600", True, False, None]},
        {"nan": float("nan"), "inf": float("inf")},
        [], "", 0,
    ]
    for value in values:
        text = json_dumps(value)
        assert text == json.dumps(value)
        assert json.dumps(json_loads(text.encode())) == json.dumps(json.loads(text))
    assert json_loads(' \n{"a": [1, 2.5e3, "\\u00e9", -Infinity]}\t') == {"a": [1, 2500.0, "\u00e9", float("-inf")]}
    for bad in (b'{"a": 1} {}', b'{"a"', b"", b"[1,]"):
        with pytest.raises(ValueError):
            json_loads(bad)
    with pytest.raises(TypeError, match="not JSON serializable"):
        json_dumps({"x": object()})
    for n in range(70):
        data = bytes(range(256))[n:] * (n % 3)
        assert b64encode(data) == base64.b64encode(data).decode()
        assert b64decode(b64encode(data)) == data
