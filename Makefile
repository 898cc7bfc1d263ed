# The two commands of the README:
#   make demo   trains the Fashion-MNIST CNN for one epoch on LibTorch 2.x
#   make test   builds and tests frugal on both LibTorch builds (2.x wheel, Debian 1.13),
#               then with AddressSanitizer + UndefinedBehaviorSanitizer (on 1.13), fuzzing
#               the IDX reader
# Both install what is missing first (scripts/setup.sh) and reuse earlier build trees.

BUILDS ?= torch2 debian sanitize
DEMO_FLAGS ?= --model cnn --epochs 1 --threads 2

.PHONY: demo test clean $(addprefix build-,$(BUILDS)) $(addprefix test-,$(BUILDS))

# The demo builds only the library and the example it runs, not the tests.
demo:
	@scripts/setup.sh torch2
	@echo "demo: configuring the 'torch2' preset and building the fashion_mnist example"
	cmake --preset torch2 > build-demo.log 2>&1 || (cat build-demo.log; exit 1)
	cmake --build build/torch2 -j 2 --target fashion_mnist
	@rm -f build-demo.log
	@echo "demo: training the Fashion-MNIST CNN for one epoch ($(DEMO_FLAGS))"
	./build/torch2/examples/fashion_mnist $(DEMO_FLAGS)

test: $(addprefix test-,$(BUILDS))
	@echo "test: all builds passed: $(BUILDS)"

$(addprefix build-,$(BUILDS)): build-%:
	@scripts/setup.sh $*
	@echo "build: configuring and building the '$*' preset"
	cmake --preset $* > build-$*.log 2>&1 || (cat build-$*.log; exit 1)
	cmake --build --preset $*
	@rm -f build-$*.log

$(addprefix test-,$(BUILDS)): test-%: build-%
	@echo "test: running the '$*' suite"
	ctest --preset $*

clean:
	rm -rf build
