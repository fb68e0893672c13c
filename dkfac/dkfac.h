#pragma once

/// dkfac: distributed K-FAC preconditioning for LibTorch. Include this header to get the user API:
/// dkfac::nn::Linear / Conv2d, dkfac::Options and dkfac::Preconditioner for a training loop, and for
/// distributed runs comm::Communicator (connect, from_environment, ...), comm::JobEnvironment and
/// parallel::DataParallel; configure_allocator() for a training process; plus the version. Other headers
/// under dkfac/ are internal (math kernels, placement, strategies, factor capture): see
/// docs/ARCHITECTURE.md, "Public and internal headers".

#include "dkfac/allocator.h"
#include "dkfac/comm/communicator.h"
#include "dkfac/comm/environment.h"
#include "dkfac/device.h"
#include "dkfac/nn/conv2d.h"
#include "dkfac/nn/embedding.h"
#include "dkfac/nn/kfac_module.h"
#include "dkfac/nn/linear.h"
#include "dkfac/optim/kfac.h"
#include "dkfac/options.h"
#include "dkfac/parallel/data_parallel.h"
#include "dkfac/preconditioner.h"
#include "dkfac/version.h"
