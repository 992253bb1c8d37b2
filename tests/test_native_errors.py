"""The native module raises gpushare's own errors: its exception translator
hands every C++ failure to gpushare._errors.translate, so a native call that
no Python wrapper guards still raises an error of the hierarchy, with UCX's
status name."""

from __future__ import annotations

import pytest

import gpushare
from gpushare._ucx._loader import native


def test_a_bare_native_call_raises_a_gpushare_error_with_its_status():
    with pytest.raises(gpushare.UCXInvalidError) as info:
        native().serialized_remote_key_range(b"too short")
    assert info.value.status == "UCS_ERR_INVALID_PARAM"
    assert "serialized remote key is 9 bytes" in info.value.message
    assert isinstance(info.value, ValueError)


def test_a_closed_native_object_raises_the_translated_error():
    node = native().Node({"TLS": "tcp"}, False, True, -1)
    node.close()
    with pytest.raises(gpushare.UCXInvalidError, match=r"the UCX node is closed \[UCS_ERR_INVALID_PARAM\]"):
        node.address()


def test_the_module_exposes_no_native_exception_type():
    assert not hasattr(native(), "NativeError")


def test_remote_key_problem_names_the_fault_without_raising():
    assert "at least" in native().remote_key_problem(b"x")
    assert native().remote_key_problem(b"\0" * 40) != ""
