// frugal: composable memory policies and a memory probe for LibTorch training steps.
#pragma once

#include "frugal/compat.h"
#include "frugal/memory/counting_allocator.h"
#include "frugal/memory/format.h"
#include "frugal/memory/ledger.h"
#include "frugal/memory/probe.h"
#include "frugal/policy/leak_guard.h"
#include "frugal/report/sink.h"
#include "frugal/train/batch.h"
#include "frugal/train/options.h"
#include "frugal/train/policy.h"
#include "frugal/train/running_mean.h"
#include "frugal/train/step_report.h"
#include "frugal/train/trainer.h"
#include "frugal/data/idx.h"
