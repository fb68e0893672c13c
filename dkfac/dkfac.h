#pragma once

/// dkfac: distributed K-FAC preconditioning for LibTorch. Include this header to get everything a
/// training loop needs: dkfac::nn::Linear / Conv2d, dkfac::Options and dkfac::Preconditioner.

#include "dkfac/assign/assignment.h"
#include "dkfac/assign/plan.h"
#include "dkfac/comm/communicator.h"
#include "dkfac/comm/environment.h"
#include "dkfac/layers/kfac_layer.h"
#include "dkfac/math/factors.h"
#include "dkfac/math/second_order.h"
#include "dkfac/nn/conv2d.h"
#include "dkfac/nn/kfac_module.h"
#include "dkfac/nn/linear.h"
#include "dkfac/options.h"
#include "dkfac/parallel/data_parallel.h"
#include "dkfac/preconditioner.h"
#include "dkfac/strategy/distributed.h"
#include "dkfac/strategy/spd.h"
#include "dkfac/version.h"
