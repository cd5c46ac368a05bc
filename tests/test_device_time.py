"""Where a device's time went (`interlace.device_time`), from a Chrome trace written here by
hand: span, busy time as the union over streams, idle, time by kind of kernel, and the
communication no computation hid; real kernel names sorted into their kinds; the report's JSON
form of it."""

import dataclasses
import json

import pytest

from interlace.device_time import DeviceTime, describe, device_time, kind


def _event(name: str, start: float, end: float, cat: str = "kernel", stream: int = 7) -> dict:
    """An event from `start` to `end` milliseconds (the trace counts microseconds)."""
    return {
        "ph": "X",
        "cat": cat,
        "name": name,
        "ts": start * 1e3,
        "dur": (end - start) * 1e3,
        "tid": stream,
    }


TRACE = {
    "traceEvents": [
        _event("aten::mm", 0, 40, cat="cpu_op"),  # host work: not the device's
        _event("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 0, 10),
        _event("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 10, 15),
        # 15..18: idle
        _event("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 18, 30, stream=20),
        _event("triton_poi_fused_add_gelu_3", 20, 25),  # hides 5 of the all-reduce's 12
        _event("Memcpy HtoD (Pinned -> Device)", 31, 32, cat="gpu_memcpy"),
    ]
}


def test_busy_is_the_union_over_streams_and_exposed_communication_what_nothing_hid():
    time = device_time(TRACE, steps=2)  # per step: half of the trace's milliseconds
    assert time.span == pytest.approx(32e-3 / 2)
    assert time.busy == pytest.approx((15 + 12 + 1) * 1e-3 / 2)
    assert time.idle == pytest.approx((3 + 1) * 1e-3 / 2)
    assert time.exposed_communication == pytest.approx(7e-3 / 2)
    assert time.by_kind == pytest.approx(
        {
            "communication": 12e-3 / 2,
            "matmul": 10e-3 / 2,
            "attention": 5e-3 / 2,
            "other": 5e-3 / 2,
            "copies": 1e-3 / 2,
        }
    )
    assert list(time.by_kind) == ["communication", "matmul", "attention", "other", "copies"]
    text = describe(time)
    assert "(mean of 2 profiled): span 16.00 ms, busy 14.00 ms (87.5%), idle 2.00 ms" in text
    assert "communication 6.00 ms, matmul 5.00 ms" in text
    assert "communication not hidden under computation: 3.50 ms" in text


def test_a_trace_without_device_events_has_no_device_time():
    assert device_time({"traceEvents": [_event("aten::mm", 0, 5, cat="cpu_op")]}, 1) is None
    assert device_time({}, 1) is None


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        (
            "void cutlass::Kernel2<cutlass_75_tensorop_bf16_s1688gemm_bf16_64x64_nn_align1>",
            "matmul",
        ),
        ("_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9x", "matmul"),
        ("sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize128x32x8", "matmul"),
        ("triton_tem_fused_mm_4", "matmul"),
        (
            "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<>",
            "multi-tensor (optimizer, norms, foreach copies)",
        ),
        ("ncclDevKernel_AllGather_RING_LL", "communication"),
        ("triton_poi_fused__grouped_mm__to_copy_transpose_16", "other"),
        ("Memset (Device)", "copies"),
    ],
)
def test_kernels_are_sorted_into_kinds_by_their_names(name, expected):
    assert kind(name) == expected


def test_the_report_keeps_it_as_json_that_gives_the_same_description_back():
    time = device_time(TRACE, steps=2)
    stored = json.loads(json.dumps(dataclasses.asdict(time)))  # as report.json holds it
    assert DeviceTime(**stored) == time
    assert describe(DeviceTime(**stored)) == describe(time)
