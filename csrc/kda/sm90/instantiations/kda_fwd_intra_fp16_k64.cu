// kda_fwd_intra for fp16, K=64.
#include "kda/sm90/kda_fwd_intra.cuh"
#include "kda/sm90/kda_fwd_launch.h"

KF_KDA_DEFINE_INTRA_SELECT(__half, 64)
