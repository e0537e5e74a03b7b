// Machine topology through hwloc: NUMA nodes, their cores, memory binding.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace kt {

struct NumaNode {
  int os_index = 0;           // the node's number as the OS names it
  std::vector<int> cores;     // one OS cpu index per physical core (first hardware thread)
  uint64_t memory_bytes = 0;  // local memory; 0 when the OS does not say
};

struct Topology {
  std::vector<NumaNode> nodes;  // a machine without NUMA information is one node
  std::string hwloc_version;
  bool membind_supported = false;  // whether memory can be bound to a node here
  int num_cores() const;
};

// Loaded once per process.
const Topology& topology();

// Binds the calling thread to one OS cpu, or to a set of them; returns false when the OS refuses.
bool bind_current_thread(int os_cpu);
bool bind_current_thread_to(const std::vector<int>& os_cpus);

// Page-aligned memory bound to a NUMA node when the OS allows it, otherwise plain.
void* alloc_on_node(size_t bytes, int node_os_index);
void free_on_node(void* ptr, size_t bytes);

}  // namespace kt
