"""Without a GPU: the Triton GEMM kernels compile for sm_90 (fresh process, no interpreter) and use Hopper's
warpgroup MMA (wgmma) in BF16 with the hardware E4M3 -> f16 conversion in the MX load path."""
import json

from _triton_mode import run_aot

_AOT = r'''
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mxcomm.gemm import triton_gemm as TG

def ptx(fn, sig, consts, **opts):
    attrs = {(i,): [["tt.divisibility", 16]] for i, (n, t) in enumerate(sig.items())
             if t.startswith("*") or n in ("N", "K")}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]

out = {}
for a_mx, lay, w_mx in ((True, 2, True), (True, 0, True), (False, 0, True), (True, 2, False), (False, 0, False)):
    sig = {"a_ptr": "*u8" if a_mx else "*bf16", "as_ptr": "*u8", "w_ptr": "*u8" if w_mx else "*bf16", "ws_ptr": "*u8",
           "offs_ptr": "*i32", "out_ptr": "*bf16", "M": "i32", "N": "i32", "n_groups": "i32", "as_cols": "i32",
           "K": "constexpr", "A_MX": "constexpr", "A_LAYOUT": "constexpr", "W_MX": "constexpr",
           "INT_ROUND": "constexpr",
           "DOT_F32": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
           "GROUP_M": "constexpr", "G_POW2": "constexpr"}
    out[f"mm-{a_mx}-{lay}-{w_mx}"] = ptx(TG._grouped_mm_kernel, sig, dict(K=4096, A_MX=a_mx, A_LAYOUT=lay, W_MX=w_mx,
        INT_ROUND=False, DOT_F32=False, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, G_POW2=8),
        num_warps=8, num_stages=3)
for x_mx, lay in ((True, 2), (True, 0), (False, 0)):
    wsig = {"go_ptr": "*bf16", "x_ptr": "*u8" if x_mx else "*bf16", "xs_ptr": "*u8", "offs_ptr": "*i32",
            "out_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32", "n_groups": "i32", "xs_cols": "i32",
            "X_MX": "constexpr", "X_LAYOUT": "constexpr", "INT_ROUND": "constexpr", "INTERP": "constexpr",
            "ACCUMULATE": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
            "G_POW2": "constexpr"}
    out[f"wgrad-{x_mx}-{lay}"] = ptx(TG._grouped_wgrad_kernel, wsig, dict(X_MX=x_mx, X_LAYOUT=lay, INT_ROUND=False,
        INTERP=False, ACCUMULATE=True, BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, G_POW2=8), num_warps=8, num_stages=3)
zsig = {"out_ptr": "*bf16", "offs_ptr": "*i32", "n_groups": "i32", "M": "i32", "N": "i32", "stride_m": "i32",
        "BLOCK_M": "constexpr", "BLOCK_N": "constexpr"}
out["zero"] = ptx(TG._zero_tail_kernel, zsig, dict(BLOCK_M=32, BLOCK_N=256), num_warps=4)
json.dump(out, sys.stdout)
'''


def test_gemm_kernels_compile_for_sm90(tmp_path):
    stdout = run_aot(_AOT, tmp_path)
    ptx = json.loads(stdout)
    for name, p in ptx.items():
        if name.startswith(("mm", "wgrad")):
            assert "wgmma.mma_async" in p and ".bf16.bf16" in p, f"{name}: no BF16 warpgroup MMA"
            assert ("cvt.rn.f16x2.e4m3x2" in p) == ("True" in name), f"{name}: E4M3 decode path"
        assert "st.global" in p
