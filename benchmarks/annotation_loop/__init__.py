"""The annotation loop's learning curve, on synthetic pages (:mod:`.synthetic`) or on real documents
(:mod:`.real`, ``--real``): does correcting the pages a policy picks make the model read better, and
do mined pages beat the least confident or random ones at the same budget?"""
