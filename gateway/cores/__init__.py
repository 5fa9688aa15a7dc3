"""Process topology, no HTTP (nothing here imports starlette): the messages between front
ends and engine cores (`wire`), the engine core and its process, the core client a front
end holds, launching and watching child processes, restarts, and the `--api-workers`
supervisor."""
