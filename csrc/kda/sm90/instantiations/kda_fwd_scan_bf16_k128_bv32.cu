// kda_fwd_scan v2 for bf16, K=128, V-slice 32 (2 warps: few sequences).
#include "kda/sm90/kda_fwd_scan.cuh"
#include "kda/sm90/kda_fwd_scan_launch.h"

KF_KDA_DEFINE_SCAN2(__nv_bfloat16, 128, 32)
