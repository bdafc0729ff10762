"""Everything that reads or patches NVIDIA Dynamo: G4's registration inside ``dynamo.sglang`` (``mooncake``)
and the router's view of what each worker holds (``router_view``)."""
