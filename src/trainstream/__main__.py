"""``python -m trainstream``: what this installation was built with and what it sees."""

from __future__ import annotations

import platform
import sys

from . import __version__, _distribution, _native


def build_report() -> list[tuple[str, str]]:
    import torch

    dists = _distribution.installed()
    ours = ", ".join(d.name for d in dists if d.ours) or "none installed: a source checkout"
    rows = [
        ("trainstream", f"{__version__} (distribution: {ours})"),
        ("python", sys.version.split()[0]),
        ("platform", f"{platform.system()} {platform.machine()}"),
    ]
    clash = _distribution.conflict(dists, _distribution.dist_for_torch(torch.version.cuda))
    if clash is not None:
        rows.append(("distributions", f"CONFLICT: {clash}"))
    try:
        native = _native.lib()
    except RuntimeError as exc:
        return rows + [("native module", f"NOT LOADED: {exc}")]
    info = _native.build_info()
    rows.append(("native compiler", info["compiler"]))
    if info["cuda"]:
        rows.append(("CUDA (wheel built for)", info["cuda_version"]))
        rows.append(("CUDA architectures", info["cuda_archs"]))
        cuda = native.cuda_info()
        driver = cuda["driver_version"]
        rows.append(("NVIDIA driver supports CUDA", _native.driver_summary(driver, cuda["runtime_version"])))
    else:
        rows.append(("CUDA (wheel built for)", "none: built without CUDA kernels"))
    rows.append(("SIMD (host AdamW)", f"{native.simd_level()} (best on this CPU: {native.best_simd_level()})"))
    rows.append(("host cores available", str(native.available_cores())))
    rows.append(("torch", f"{torch.__version__} (CUDA {torch.version.cuda or 'none: CPU-only build'})"))
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            rows.append(
                (f"GPU {i}", f"{props.name}, {props.total_memory / 2**30:.1f} GiB, sm_{props.major}{props.minor}")
            )
    else:
        rows.append(("GPUs", "none visible to torch"))
    try:
        _native.require_cuda("TrainStream's GPU path")
        rows.append(("GPU features", "ready"))
    except RuntimeError as exc:
        rows.append(("GPU features", f"unavailable: {exc}"))
    return rows


def main() -> None:
    rows = build_report()
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


if __name__ == "__main__":
    main()
