// kda_fwd_scan for bf16, K=64, V-slice 128.
#include "kda/sm90/kda_fwd_scan.cuh"
#include "kda/sm90/kda_fwd_launch.h"

KF_KDA_DEFINE_SCAN(__nv_bfloat16, 64, 128)
