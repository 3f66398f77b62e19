"""The Faust stream application (SPEC §3): raw topic → Redis buffers → published topic.

It calls the privacy core in `service` and holds no mechanism logic of its own.
"""
