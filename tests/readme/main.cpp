// The C++ snippets of README.md and docs/, compiled and linked into this program
// (extract_snippets.py); it says how many there are, and runs none of them.
#include <cstdio>

namespace readme {
struct Given;
}
int readme_snippet_count();

int main() {
  std::printf("README.md and docs/: %d C++ snippets compiled and linked\n", readme_snippet_count());
  return readme_snippet_count() > 0 ? 0 : 1;
}
