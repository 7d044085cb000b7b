"""Pieces the omni families (thinker -> talker -> speech decoder) share: the thinker's streaming
loop and its record (``thinker.py``), prompt media by position (``media.py``), the talker's
stream-fed AR loop (``talker.py``), the admission checks of a request's parts (``admission.py``)."""
