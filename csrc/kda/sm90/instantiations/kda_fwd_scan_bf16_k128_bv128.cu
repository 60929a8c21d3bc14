// kda_fwd_scan v1 to v5 for bf16, K=128, V-slice 128.
#include "kda/sm90/kda_fwd_scan.cuh"
#include "kda/sm90/kda_fwd_launch.h"
#include "kda/sm90/kda_fwd_scan_launch.h"

KF_KDA_DEFINE_SCAN(__nv_bfloat16, 128, 128)
KF_KDA_DEFINE_SCAN2(__nv_bfloat16, 128, 128)
KF_KDA_DEFINE_SCAN3(__nv_bfloat16, 128, 128)
KF_KDA_DEFINE_SCAN4(__nv_bfloat16, 128, 128)
KF_KDA_DEFINE_SCAN5(__nv_bfloat16, 128, 128)
