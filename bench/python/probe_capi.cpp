// frugal's counting CPU allocator behind a C interface, for Python (ctypes) to measure
// PyTorch's CPU memory the way frugal measures LibTorch's. Load it after `import torch`,
// so both share one LibTorch.
#include <frugal/memory/counting_allocator.h>

extern "C" {
void frugal_probe_install() { frugal::CountingAllocator::install(); }
void frugal_probe_uninstall() { frugal::CountingAllocator::uninstall(); }
long long frugal_probe_allocated() { return frugal::CountingAllocator::stats().allocated; }
long long frugal_probe_peak() { return frugal::CountingAllocator::stats().peak; }
void frugal_probe_reset_peak() { frugal::CountingAllocator::reset_peak(); }
}
