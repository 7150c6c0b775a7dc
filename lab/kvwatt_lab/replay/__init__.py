"""`kvwatt replay`: replay agentic multi-turn traces against an OpenAI-compatible server (docs/replay.md)."""
