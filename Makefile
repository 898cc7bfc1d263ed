# The two commands of the README:
#   make demo   trains the Fashion-MNIST CNN for one epoch on LibTorch 2.x
#   make test   builds and tests frugal on both LibTorch builds (2.x wheel, Debian 1.13),
#               then with AddressSanitizer + UndefinedBehaviorSanitizer (on 1.13), fuzzing
#               the IDX reader
# And for the figures: make bench-doc runs the benchmarks of bench/doc.json (on a quiet
# machine) and writes docs/benchmarks.md and the README's speed table from their output.
# Both install what is missing first (scripts/setup.sh) and reuse earlier build trees.

BUILDS ?= torch2 debian sanitize
DEMO_FLAGS ?= --model cnn --epochs 1 --threads 2 --memory-timeline build/torch2/demo-step2.html

.PHONY: demo test bench-doc clean $(addprefix build-,$(BUILDS)) $(addprefix test-,$(BUILDS))

# The demo installs only what it uses (scripts/setup.sh demo) and builds only the library
# and the example it runs: the tests and benchmarks are left out of its configure (make
# test's presets turn them on again), and it compiles through make test's torch2 cache.
demo:
	@scripts/setup.sh demo
	@echo "demo: configuring the 'torch2' preset and building the fashion_mnist example"
	cmake --preset torch2 -DFRUGAL_BUILD_TESTS=OFF -DFRUGAL_BUILD_BENCHMARKS=OFF \
	  -DFRUGAL_CCACHE_DIR=$(CCACHE_ROOT)/torch2 > build-demo.log 2>&1 || (cat build-demo.log; exit 1)
	cmake --build build/torch2 -j 2 --target fashion_mnist
	@rm -f build-demo.log
	@echo "demo: training the Fashion-MNIST CNN for one epoch ($(DEMO_FLAGS))"
	./build/torch2/examples/fashion_mnist $(DEMO_FLAGS)

# Each build and each suite is a timed stage; the table of their times (and how much of each
# build its compiler cache served) is printed at the end, whether the stages passed or not.
test:
	@scripts/stage.sh reset
	@status=0; for b in $(BUILDS); do \
	  $(MAKE) --no-print-directory test-$$b || { status=1; break; }; \
	done; \
	scripts/stage.sh summary; \
	if [ $$status -eq 0 ]; then echo "test: all builds passed: $(BUILDS)"; fi; \
	exit $$status

# Each build kind compiles through its own ccache cache (cmake/FrugalCcache.cmake).
CCACHE_ROOT ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/frugal/ccache

$(addprefix build-,$(BUILDS)): build-%:
	@scripts/stage.sh run "setup $*" - scripts/setup.sh $*
	@echo "build: configuring and building the '$*' preset"
	@scripts/stage.sh run "build $*" $(CCACHE_ROOT)/$* sh -c '\
	  cmake --preset $* -DFRUGAL_CCACHE_DIR=$(CCACHE_ROOT)/$* > build-$*.log 2>&1 \
	    || { cat build-$*.log; exit 1; }; \
	  rm -f build-$*.log; \
	  cmake --build --preset $*'

$(addprefix test-,$(BUILDS)): test-%: build-%
	@echo "test: running the '$*' suite"
	@scripts/stage.sh run "suite $*" - ctest --preset $*

bench-doc: build-torch2 build-debian
	scripts/bench_doc.py --run

clean:
	rm -rf build
