// frugal across processes: the process group, data parallel, ZeRO stages 1-3, the ranks'
// shares and evaluation, SyncBatchNorm. frugal/frugal.h is the one-process core.
#pragma once

#include "frugal/distributed/batch_norm.h"
#include "frugal/distributed/data_parallel.h"
#include "frugal/distributed/group.h"
#include "frugal/distributed/ranks.h"
#include "frugal/distributed/reducer.h"
#include "frugal/distributed/shard.h"
#include "frugal/distributed/zero.h"
