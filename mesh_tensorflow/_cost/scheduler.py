"""Operation orders that keep peak memory low (public as upstream's `mtf.auto_mtf.scheduler`).

The memory estimate of the cost model schedules with it; the layout search reuses it.

Schedules are lists of operation ids (graph order numbers of a GraphInterface).
"""

from __future__ import annotations

import collections

ALGORITHMS = ("NAIVE", "LIST")


def minimize_peak_memory(graph, scheduler_alg: str = "LIST") -> list:
  """A topological order of `graph` (a GraphInterface) chosen to keep peak memory low.

  Args:
    graph: a GraphInterface.
    scheduler_alg: "NAIVE" (graph order) or "LIST" (greedy: next, the ready operation that frees
      the most bytes net of what it allocates; ties go to graph order).
  """
  if scheduler_alg == "NAIVE":
    return list(range(graph.get_num_operations()))
  if scheduler_alg == "LIST":
    return _list_schedule(graph)
  raise ValueError(f"Unknown scheduler_alg {scheduler_alg!r}; use one of {ALGORITHMS}.")


def _list_schedule(graph) -> list:
  names = graph.get_all_operation_names()
  inputs = {op: list(dict.fromkeys(graph.get_operation_input_names(op))) for op in names}
  outputs = {op: list(graph.get_operation_output_names(op)) for op in names}
  producer = {t: op for op in names for t in outputs[op]}
  pending_users = collections.Counter(t for op in names for t in inputs[op])
  waiting_on = {op: sum(1 for t in inputs[op] if t in producer) for op in names}
  users = collections.defaultdict(list)
  for op in names:
    for t in inputs[op]:
      users[t].append(op)
  ids = {op: i for i, op in enumerate(names)}
  size = {t: graph.get_tensor_size(t) for op in names for t in outputs[op]}  # asked once per tensor
  final = {t for t in size if graph.is_tensor_final(t)}

  def net_bytes_freed(op):
    freed = sum(size[t] for t in inputs[op] if pending_users[t] == 1 and t not in final)
    allocated = sum(size[t] for t in outputs[op] if users[t] or t in final)
    return freed - allocated

  ready = [op for op in names if waiting_on[op] == 0]
  schedule = []
  while ready:
    best = max(ready, key=lambda op: (net_bytes_freed(op), -ids[op]))
    ready.remove(best)
    schedule.append(ids[best])
    for t in inputs[best]:
      pending_users[t] -= 1
    for t in outputs[best]:
      for user in users[t]:
        waiting_on[user] -= 1
        if waiting_on[user] == 0:
          ready.append(user)
  return schedule
