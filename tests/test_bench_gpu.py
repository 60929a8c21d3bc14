"""The benchmark's timing on the device: --host-ahead (kernel_fun.bench.run.time_calls) times the
GPU's work of a call whose host side is slower than its kernels, where plain events time the host."""

from __future__ import annotations

import time

import pytest
import torch


@pytest.mark.gpu
def test_host_ahead_times_the_gpu_not_the_host():
    from kernel_fun.bench import run as brun

    rate = brun.sleep_cycles_per_ms(torch)  # torch.cuda._sleep's cycles per ms: the SM clock
    assert 5e5 < rate < 3e6, rate
    x = torch.ones(1 << 20, device="cuda")

    def step():  # 5 ms of host work, then one ~us kernel: launch-bound as the small rows are
        time.sleep(0.005)
        x.mul_(1.0)

    plain = brun.time_calls(torch, step, warmup=2, iters=3)
    ahead = brun.time_calls(torch, step, warmup=2, iters=3, host_ahead=True)
    assert plain["ms"] > 4.0, plain     # the events saw the host's 5 ms
    assert ahead["ms"] < 1.0, ahead     # the GPU's: the call was queued before its kernel ran
