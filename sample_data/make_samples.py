"""Generate the sample datasets (deterministic, no network): ``python sample_data/make_samples.py``.

Four kinds of documents a reader will recognise, each under its own reference material and system prompt:

    domain        documents                      reference (1,000-2,000 tokens)
    support       customer support tickets       Brightline Appliances returns & warranty policy
    it            IT incident reports            Incident severity and response guide
    tenancy       apartment maintenance requests Maple Court tenant handbook
    insurance     home insurance claims          HomeSure policy summary

Writes ``sample_data/documents.parquet`` (240 rows: id, domain, created, region, priority, system, reference,
document) and ``sample_data/support_extra/`` (a ``datasets`` save_to_disk copy of 60 more support tickets,
same reference as the support rows, so a job over it shares the reference with a job over the Parquet).
``--check`` counts tokens with the default model's tokenizer (slow to load) and prints the ranges.
"""
from __future__ import annotations

import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

NAMES = ["Amira Haddad", "Ben Okafor", "Chloe Martin", "Dmitri Volkov", "Elena Rossi", "Farid Khan", "Grace Liu",
         "Hugo Lambert", "Ines Duarte", "Jonas Berg", "Keiko Tanaka", "Liam O'Brien", "Maya Patel", "Noah Fischer",
         "Olivia Brown", "Pedro Alvarez", "Quinn Murphy", "Rosa Jimenez", "Samuel Cohen", "Tara Singh"]
REGIONS = ["north", "south", "east", "west"]
PRIORITIES = ["low", "normal", "high"]

SYSTEM = {
    "support": "You are a customer support lead at Brightline Appliances. Summarize the ticket in two "
               "sentences: what the customer wants and what the policy says should happen.",
    "it": "You are an IT operations manager. Summarize the incident report in two sentences: what broke, "
          "its severity under the guide, and what is still open.",
    "tenancy": "You are the property manager of Maple Court. Summarize the maintenance request in two "
               "sentences: the problem, how urgent it is under the handbook, and who pays.",
    "insurance": "You are a claims handler at HomeSure. Summarize the claim in two sentences: what happened, "
                 "whether the policy covers it, and the likely payout after the excess.",
}


# ---- reference material -------------------------------------------------------------------------------
def _reference(title: str, intro: str, sections: list[tuple[str, list[str]]]) -> str:
    out = [title, "", intro, ""]
    n = 0
    for heading, clauses in sections:
        out.append(heading)
        for c in clauses:
            n += 1
            out.append(f"{n}. {c}")
        out.append("")
    return "\n".join(out).strip()


def _support_reference() -> str:
    products = [("refrigerators", 24, 5), ("washing machines", 24, 3), ("dishwashers", 24, 3),
                ("ovens", 24, 2), ("microwaves", 12, 1), ("vacuum cleaners", 12, 2), ("kettles", 12, 1),
                ("coffee machines", 12, 2), ("air purifiers", 12, 2), ("toasters", 12, 1)]
    warranty = [f"{p.capitalize()} carry a {m}-month parts and labour warranty from the delivery date; the "
                f"compressor or motor is covered for {y} year{'s' if y > 1 else ''} beyond that for parts only."
                for p, m, y in products]
    return _reference(
        "Brightline Appliances: Returns, Refunds and Warranty Policy (customer support edition)",
        "This policy tells support agents what customers are entitled to. Apply it as written; when a case "
        "does not fit, escalate to a team lead rather than improvising. Always quote the clause number to "
        "the customer so they can check it themselves.",
        [("Returns",
          ["Any item may be returned within 30 days of delivery for a full refund if it is unused and in its "
           "original packaging.",
           "Opened items in working order may be returned within 30 days, minus a 15 percent restocking fee.",
           "Items returned after 30 days are not refunded, but are still covered by the warranty below.",
           "Brightline pays return shipping only when the item arrived damaged, was faulty, or was the wrong "
           "item; otherwise the customer pays return shipping.",
           "Large appliances (refrigerators, washing machines, dishwashers and ovens) are collected by our "
           "courier; the customer must book a collection slot within 14 days of the return being approved."]),
         ("Refunds",
          ["Refunds go back to the original payment method within 5 business days of the return arriving "
           "at the warehouse.",
           "If the original payment method has expired, the refund is issued as store credit, which never "
           "expires, or by bank transfer if the customer asks.",
           "Gift purchases are refunded as store credit to the recipient unless the buyer asks otherwise.",
           "Delivery fees are refunded only when the whole order is returned because of our mistake."]),
         ("Damaged or late deliveries",
          ["Damage found at delivery must be reported within 48 hours with photos; we then send a "
           "replacement at no cost, or a refund if no replacement is in stock.",
           "A delivery more than 7 days later than the promised date entitles the customer to a refund of "
           "the delivery fee, whether or not they keep the item.",
           "A missed delivery slot caused by our courier entitles the customer to a 20 dollar voucher."]),
         ("Warranty", warranty + [
           "The warranty does not cover damage from misuse, power surges, incorrect installation by a "
           "third party, or cosmetic wear such as scratches and dents.",
           "A product that fails three times within its warranty period is replaced with a new unit of the "
           "same or a better model, at no cost.",
           "Warranty repairs are booked within 5 business days; if no engineer is available in that time, "
           "the customer may choose a replacement instead.",
           "Proof of purchase is needed for warranty claims; an order number or a bank statement is enough."]),
         ("Escalation and goodwill",
          ["Agents may offer goodwill credit of up to 50 dollars without approval when a customer has been "
           "inconvenienced; more than that needs a team lead.",
           "Complaints about staff conduct are always escalated to a team lead the same day.",
           "A customer who says they will take legal action is escalated to the customer relations team, "
           "and the agent stops negotiating."]),
         ("Worked examples", [
             f"A customer's {p[:-1]} breaks down {m + 6} months after delivery. The {m}-month warranty has ended, "
             f"so labour is charged; parts for the compressor or motor are still free for another {y} "
             f"year{'s' if y > 1 else ''}. Other parts are charged. Quote the warranty clause."
             for p, m, y in products] + [
             "A customer returns a sealed kettle after 12 days because they changed their mind. They get a full "
             "refund, but they pay the return shipping themselves.",
             "A customer returns an opened toaster in working order after 20 days. They get the price back minus "
             "the 15 percent restocking fee.",
             "A dishwasher is delivered 9 days late and the customer keeps it. They get the delivery fee back."])])


def _it_reference() -> str:
    systems = [("the payroll system", "P1"), ("customer-facing websites", "P1"), ("the VPN", "P2"),
               ("email", "P2"), ("the internal wiki", "P3"), ("printers", "P4"), ("build servers", "P3"),
               ("the data warehouse", "P2"), ("single sign-on", "P1"), ("office Wi-Fi", "P3")]
    default_sev = [f"An outage of {s} is {p} by default, one level lower if a documented workaround exists."
                   for s, p in systems]
    return _reference(
        "Incident Severity and Response Guide (IT Operations)",
        "Every incident gets a severity from P1 (worst) to P4 when it is opened. The severity decides who "
        "is paged, how fast we respond, and what we report afterwards. Re-assess the severity whenever "
        "the impact changes, and write down why.",
        [("Severity levels",
          ["P1: a service that many customers or the whole company depend on is down, data is being lost, "
           "or there is an active security breach. Respond within 15 minutes, around the clock.",
           "P2: a major service is degraded or down for one department, or a P1 system is running without "
           "redundancy. Respond within 1 hour, around the clock.",
           "P3: a minor service is down, or a major one is slow but usable. Respond within 4 business hours.",
           "P4: a cosmetic problem, a single user affected, or a question. Respond within 2 business days."]),
         ("Default severity by system", default_sev),
         ("Response",
          ["For P1 and P2 the on-call engineer opens an incident channel, names an incident lead, and posts "
           "an update every 30 minutes (P1) or every 2 hours (P2) until resolved.",
           "Customer-facing P1 incidents get a status page notice within 30 minutes.",
           "Any suspected security incident is also reported to the security team immediately, whatever "
           "its severity.",
           "Changes made to fix an incident must be recorded in the change log within one business day.",
           "Rolling back a recent change is preferred over a new fix when the change is the likely cause."]),
         ("Closing and review",
          ["An incident is resolved when the service works normally for 1 hour; it is closed when follow-up "
           "actions have owners and dates.",
           "P1 and P2 incidents need a written post-incident review within 5 business days, blameless, with "
           "timeline, root cause, and actions.",
           "Repeated P3 incidents on the same system (three in 30 days) are reviewed as if they were one P2.",
           "Data loss must be quantified in the review: what was lost, for which period, and whether it was "
           "restored from backup.",
           "Vendor-caused incidents are reviewed with the vendor, and service credits are claimed when the "
           "contract allows."]),
         ("Worked examples", [
             f"{s[0].upper() + s[1:]} is completely down for everyone and no workaround exists: this is {p}. "
             f"If a documented workaround lets people keep working, treat it as "
             f"{'P' + str(min(int(p[1]) + 1, 4))} instead, and record the workaround in the incident channel."
             for s, p in systems] + [
             "A single user cannot print from one laptop: P4, answered within 2 business days.",
             "The payroll system is down on the day salaries are paid: P1, page the on-call engineer, open an "
             "incident channel, and post updates every 30 minutes.",
             "Login attempts fail in an unusual pattern: whatever the severity, tell the security team now."])])


def _tenancy_reference() -> str:
    items = ["boiler", "radiators", "hot water cylinder", "electrical wiring", "fuse box", "windows",
             "front door lock", "roof and gutters", "smoke alarms", "extractor fans", "plumbing pipes",
             "kitchen appliances supplied with the flat"]
    landlord = [f"The landlord is responsible for repairing the {i}, unless the tenant damaged it." for i in items]
    return _reference(
        "Maple Court Tenant Handbook: Repairs and Maintenance",
        "This handbook explains how repairs work at Maple Court, who pays for what, and how quickly we "
        "respond. Report problems through the resident portal or by phone to the management office. "
        "Emergencies can be reported at any hour on the emergency line.",
        [("Urgency categories",
          ["Emergency: a risk to safety or serious damage to the building, such as a gas smell, flooding, "
           "no heating in winter, a broken front door lock, or exposed wiring. Attended within 24 hours.",
           "Urgent: a problem that makes part of the flat hard to use, such as no hot water, a blocked "
           "toilet when there is only one, or a broken fridge supplied with the flat. Within 3 working days.",
           "Routine: everything else, such as a dripping tap, a sticking window, or a loose cupboard door. "
           "Within 20 working days.",
           "Pest problems are urgent when they affect the kitchen, otherwise routine."]),
         ("Who pays", landlord + [
           "Tenants pay for damage they, their guests or their pets caused, beyond normal wear and tear.",
           "Tenants replace light bulbs, smoke alarm batteries and fuses, and keep drains clear of grease.",
           "Blockages caused by wipes, nappies or grease are charged to the tenant at the contractor's cost.",
           "Lost keys and lockouts outside office hours are charged at a flat 90 dollars."]),
         ("Access and conduct",
          ["We give at least 24 hours' notice before entering for routine repairs; in an emergency we may "
           "enter without notice.",
           "If a contractor cannot get in at an agreed time, the tenant may be charged a 40 dollar call-out "
           "fee.",
           "Tenants must report leaks and damp promptly; damage made worse by a late report may be charged.",
           "Rent is not reduced for repairs completed within the times above; longer delays on urgent or "
           "emergency repairs earn a rent credit of 5 dollars per day."]),
         ("Worked examples", [
             f"The {i} stops working through no fault of the tenant. The landlord arranges and pays for the "
             f"repair. If the fault makes the flat unsafe or unusable it is an emergency or urgent repair; "
             f"otherwise it is routine, attended within 20 working days."
             for i in items] + [
             "A tenant's toilet, the only one in the flat, is blocked by wipes: urgent, attended within 3 "
             "working days, and the contractor's cost is charged to the tenant.",
             "The boiler fails in January: emergency, attended within 24 hours, paid by the landlord.",
             "A tenant's dog scratches through the front door: the landlord repairs it, the tenant pays."])])


def _insurance_reference() -> str:
    limits = [("water damage from burst pipes", 25000), ("fire and smoke damage", 150000),
              ("storm damage to the roof", 20000), ("theft after forced entry", 15000),
              ("accidental damage to electronics", 3000), ("subsidence", 50000),
              ("damage to garden structures", 2500), ("temporary accommodation", 10000),
              ("food spoiled by a freezer failure", 500), ("lost or stolen keys", 750)]
    cover = [f"Cover for {what} is limited to {amount:,} dollars per claim." for what, amount in limits]
    return _reference(
        "HomeSure Home Insurance: Policy Summary (Standard plan)",
        "This summary explains what the Standard plan covers, what it does not, and how claims are paid. "
        "The full policy wording takes precedence where the two differ. Every claim is subject to the "
        "excess: the amount the policyholder pays first.",
        [("Excess",
          ["The standard excess is 250 dollars per claim.",
           "Claims for water damage from escape of water carry a higher excess of 500 dollars.",
           "Subsidence claims carry an excess of 1,000 dollars.",
           "Only one excess applies when several items are damaged in the same event."]),
         ("What is covered", cover),
         ("What is not covered",
          ["Wear and tear, gradual damage, rot, mould and damage from a leak that was known but not fixed.",
           "Damage while the home has been unoccupied for more than 60 days in a row.",
           "Theft without forced entry, unless by someone who entered using deception.",
           "Damage caused deliberately by the policyholder or anyone living with them.",
           "Mechanical or electrical breakdown of appliances, unless the optional breakdown cover was bought."]),
         ("How claims are paid",
          ["Claims must be reported within 30 days of the event; late reports may reduce the payout if the "
           "delay made the loss worse.",
           "Repairs are paid in full minus the excess; items beyond repair are replaced new for old, except "
           "clothing and linen, which are paid at their current value.",
           "Claims over 5,000 dollars are visited by a loss adjuster before payment.",
           "A police crime reference number is needed for every theft claim.",
           "Payment is made within 10 business days of the claim being agreed."]),
         ("Worked examples", [
             f"A claim for {what} worth {amount // 2:,} dollars is paid as {amount // 2 - 250:,} dollars after "
             f"the standard 250 dollar excess (the limit of {amount:,} dollars is not reached). A claim worth "
             f"{amount * 2:,} dollars is paid only up to the limit, minus the excess."
             for what, amount in limits] + [
             "A burst pipe causes 8,000 dollars of damage: escape of water, so the excess is 500 dollars and "
             "the payout is 7,500 dollars.",
             "A laptop is stolen without forced entry: not covered.",
             "A leak that was known for months rots the floor: gradual damage, not covered."])])


REFERENCES = {"support": _support_reference, "it": _it_reference, "tenancy": _tenancy_reference,
              "insurance": _insurance_reference}


# ---- documents -----------------------------------------------------------------------------------------
def _a(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def _support_doc(rng: random.Random, i: int, name: str) -> str:
    product = rng.choice(["refrigerator", "washing machine", "dishwasher", "oven", "microwave", "vacuum cleaner",
                          "kettle", "coffee machine", "air purifier", "toaster"])
    order = f"BL-{rng.randint(100000, 999999)}"
    days = rng.choice([3, 9, 17, 26, 34, 45, 80, 200, 400])
    problem = rng.choice([
        f"the {product} arrived with a large dent in the side panel and the box was torn open",
        f"the {product} stopped working after {days} days; it powers on but does nothing",
        f"the {product} makes a loud grinding noise whenever it runs",
        f"I ordered a stainless steel {product} but a white one was delivered",
        f"the delivery of my {product} was {rng.choice([8, 10, 12])} days later than promised",
        f"I changed my mind about the {product}; it is still sealed in its box",
        f"the {product} has failed for the third time since I bought it",
        "the courier missed the delivery slot twice and nobody called me",
    ])
    want = rng.choice(["a full refund", "a replacement", "a repair visit", "compensation for my time",
                       "my delivery fee back", "to return it and buy a different model"])
    paras = [f"Ticket {i} from {name}, order {order}.",
             f"Hello, I bought {_a(product)} from you {days} days ago and {problem}. I would like {want}."]
    extras = [
        f"I have attached {rng.randint(2, 6)} photos showing the problem and the packaging.",
        "I paid with a credit card that has since expired, so I am not sure how a refund would reach me.",
        f"This {product} was a gift for my {rng.choice(['mother', 'brother', 'neighbour', 'friend'])}.",
        "I have already called twice and was told someone would ring me back, but nobody did.",
        f"The engineer who came on {rng.choice(['Monday', 'Tuesday', 'Thursday'])} said the part was on order "
        "but gave no date.",
        "I was at home all day and the doorbell works, so I do not understand why the courier said I was out.",
        "To be honest I am very disappointed, because I chose Brightline after a friend recommended you.",
        "I had the unit installed by a local electrician rather than your installer, if that matters.",
        f"I can be reached on weekdays after {rng.choice(['4', '5', '6'])} pm, or by email at any time.",
        "The manual says to reset the unit by unplugging it for a minute; I tried that three times.",
        "I noticed a burning smell the last time I used it, so I have stopped using it altogether.",
        "I still have the original packaging in the garage if you need it back.",
        "If this cannot be sorted out this week I will have to consider taking the matter further.",
    ]
    timeline = [f"Day {d}: " + rng.choice([
        "I contacted support through the chat window and was given a reference number.",
        "an agent promised a call back within 48 hours; no call came.",
        "I tried the troubleshooting steps from the website without success.",
        "a courier collection was booked, then cancelled without explanation.",
        "I sent another email asking for an update on the case.",
        f"the {product} failed again in the same way as before."]) for d in sorted(rng.sample(range(1, 60), 8))]
    return _assemble(rng, paras, extras, timeline, f"Thank you,\n{name}")


def _it_doc(rng: random.Random, i: int, name: str) -> str:
    system = rng.choice(["the payroll system", "the customer website", "the VPN", "email", "the internal wiki",
                         "the office printers", "the build servers", "the data warehouse", "single sign-on",
                         "office Wi-Fi"])
    start = f"{rng.randint(0, 23):02d}:{rng.choice(['05', '17', '30', '42', '55'])}"
    users = rng.choice([1, 12, 40, 150, 600, 2000])
    cause = rng.choice(["an expired TLS certificate", "a full disk on the primary database", "a bad configuration "
                        "change deployed that morning", "a failed network switch", "a vendor outage",
                        "a memory leak after the last upgrade", "an unknown cause, still under investigation"])
    paras = [f"Incident report {i}, written by {name}.",
             f"At {start} monitoring alerted that {system} was failing. About {users} users were affected. "
             f"The likely cause is {cause}."]
    extras = [
        "A workaround was published: users can reach the service through the backup address.",
        "No workaround exists yet; affected staff have been asked to wait.",
        "The change that was deployed earlier the same day has been rolled back.",
        "Some records written during the outage may be missing; the backup from midnight is intact.",
        "The security team was informed because the failing logins looked unusual at first.",
        "The status page was updated about forty minutes after the first alert.",
        "The vendor has acknowledged the problem and promised a fix within the day.",
        "This is the third time this month that the same system has had a similar problem.",
        "The on-call engineer was paged twice before acknowledging, which delayed the response.",
        "Customers contacted the support desk to ask why they could not log in.",
        "Disk usage had been above ninety percent for a week without anyone acting on the warning.",
        "Follow-up actions still need owners and dates before the incident can be closed.",
    ]
    timeline = [f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d} " + rng.choice([
        "the incident channel was opened and an incident lead named.",
        "a restart of the service was attempted; it failed again within minutes.",
        "traffic was moved to the secondary site.",
        "the vendor support line was called.",
        "the service recovered and monitoring turned green.",
        "an update was posted to the incident channel.",
        "a rollback of the recent change was started."]) for _ in range(8)]
    return _assemble(rng, paras, extras, timeline, f"Report filed by {name}, IT Operations.")


def _tenancy_doc(rng: random.Random, i: int, name: str) -> str:
    flat = f"{rng.randint(1, 9)}{rng.choice('ABCD')}"
    problem = rng.choice(["the boiler has stopped and there is no heating or hot water",
                          "water is dripping through the kitchen ceiling from the flat above",
                          "the front door lock is broken and the door will not close",
                          "the toilet is blocked and it is the only one in the flat",
                          "the bathroom tap drips constantly",
                          "there are mice in the kitchen cupboards",
                          "a bedroom window will not open",
                          "the fridge that came with the flat has stopped cooling",
                          "the smoke alarm in the hallway keeps beeping",
                          "there is a smell of gas near the cooker"])
    paras = [f"Maintenance request {i} from {name}, flat {flat}.",
             f"Hello, I am writing because {problem}. It started "
             f"{rng.choice(['this morning', 'yesterday', 'three days ago', 'last week'])}."]
    extras = [
        "I am at home most days, so any time is fine for a visit.",
        "I work during the day; please call before coming so I can arrange access.",
        f"My {rng.choice(['son', 'daughter'])} is two years old, so this is worrying for us.",
        "I think my guest may have caused it by accident, and I am happy to pay if that is the rule.",
        "I already replaced the battery, but the problem continued.",
        "A contractor came last month but could not get in because I was out; sorry about that.",
        "The neighbour upstairs says they have the same problem.",
        "It is winter and the flat is very cold at night.",
        "I have put a bucket under the leak and moved my things out of the way.",
        "I cleared the drain myself with a plunger, but it blocked again the next day.",
        "I lost my keys last night and had to call the emergency line to get in.",
        "This has been reported before and was not fixed properly.",
    ]
    timeline = [rng.choice(["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"]) + ": " + rng.choice([
        "I reported it through the resident portal.",
        "I phoned the management office and left a message.",
        "a contractor visited and said a part was needed.",
        "the problem got worse overnight.",
        "I sent photos by email.",
        "nobody came at the agreed time."]) for _ in range(8)]
    return _assemble(rng, paras, extras, timeline, f"Kind regards,\n{name}, flat {flat}")


def _insurance_doc(rng: random.Random, i: int, name: str) -> str:
    event = rng.choice([("a pipe burst in the loft and water came through two ceilings", 7800),
                        ("a kitchen fire damaged the cooker, cupboards and ceiling", 21000),
                        ("a storm lifted tiles from the roof and rain got into the bedroom", 4200),
                        ("burglars forced the back door and took a laptop, jewellery and a bicycle", 6100),
                        ("I knocked the television off its stand and the screen cracked", 1400),
                        ("the freezer failed while we were away and all the food spoiled", 420),
                        ("the garden shed collapsed under snow", 3100),
                        ("my keys were stolen from my bag at the gym", 300),
                        ("a slow leak under the shower rotted the floor over several months", 5200),
                        ("cracks appeared in the walls and the surveyor suspects subsidence", 38000)])
    days = rng.choice([2, 6, 14, 25, 41])
    paras = [f"Claim {i}, policyholder {name}, policy HS-{rng.randint(1000000, 9999999)}.",
             f"On {rng.choice(['3', '11', '19', '27'])} {rng.choice(['January', 'March', 'June', 'October'])}, "
             f"{event[0]}. I estimate the damage at {event[1]:,} dollars. I am reporting it {days} days after it "
             "happened."]
    extras = [
        "The police gave me a crime reference number, which I have included below.",
        "I did not report it to the police because nothing seemed to be stolen at first.",
        "The house was empty for ten weeks while I was working abroad.",
        "I knew about a small leak before, but I thought it had stopped.",
        "I have receipts for most of the items and photos of the damage.",
        "We had to stay in a hotel for four nights because the house was not safe.",
        "A builder has quoted for the repair and I have attached the quote.",
        "Some of the damaged items are clothes and bedding bought around five years ago.",
        "I bought the optional breakdown cover when I renewed last year.",
        "A neighbour saw the whole thing and is happy to give a statement.",
        "I have already paid for an emergency plumber out of my own pocket.",
        "I would like to know how long the payment will take, as money is tight.",
    ]
    timeline = [f"Day {d}: " + rng.choice([
        "I called the claims line and was given a claim number.",
        "a loss adjuster phoned to arrange a visit.",
        "I sent the photos and receipts by email.",
        "an emergency repair was done to make the house safe.",
        "I asked for an update and was told the claim was under review.",
        "the builder started the repair work."]) for d in sorted(rng.sample(range(1, 45), 8))]
    return _assemble(rng, paras, extras, timeline, f"Yours sincerely,\n{name}")


def _assemble(rng: random.Random, paras: list[str], extras: list[str], timeline: list[str], signoff: str) -> str:
    """Vary the length: 2-12 extra remarks and 0-8 timeline entries around the fixed opening."""
    size = 0.35 + 0.65 * rng.random()
    k_extra = 5 + int(size * 7)
    k_time = 3 + int(size * 5)
    body = list(paras)
    picked = rng.sample(extras, min(k_extra, len(extras)))
    body.append(" ".join(picked[: len(picked) // 2 + 1]))
    if k_time:
        body.append("What has happened so far:\n" + "\n".join(timeline[:k_time]))
    if len(picked) > 1:
        body.append(" ".join(picked[len(picked) // 2 + 1:]))
    if size > 0.5:
        body.append("Further details:\n" + "\n".join(rng.sample(timeline, 4)) + "\n" + " ".join(rng.sample(extras, 5)))
    body.append(signoff)
    return "\n\n".join(p for p in body if p)


DOCS = {"support": _support_doc, "it": _it_doc, "tenancy": _tenancy_doc, "insurance": _insurance_doc}


def make_rows(n: int, seed: int, domains: list[str], start: int = 0) -> list[dict]:
    rng = random.Random(seed)
    refs = {d: REFERENCES[d]() for d in domains}
    rows = []
    for k in range(n):
        i = start + k
        domain = domains[k % len(domains)]
        name = rng.choice(NAMES)
        rows.append({"id": f"{domain[:3]}-{i:04d}", "domain": domain,
                     "created": f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
                     "region": rng.choice(REGIONS), "priority": rng.choice(PRIORITIES),
                     "system": SYSTEM[domain], "reference": refs[domain],
                     "document": DOCS[domain](rng, i, name)})
    rng.shuffle(rows)          # NOTE: mixed order on purpose: the planner, not the file, groups them
    return rows


def write_requests(path: Path) -> int:
    """An OpenAI Batch input (jobs/openai-batch.yaml): 8 chat requests under two system prompts (instructions +
    reference material in the system message, the document as the user message)."""
    import json
    lines = []
    for r in make_rows(8, seed=13, domains=["it", "insurance"], start=2000):
        system = f"{r['system']}\n\nReference:\n{r['reference']}"
        body = {"model": "gemma-3-270m", "max_tokens": 32, "temperature": 0,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": r["document"]}]}
        lines.append(json.dumps({"custom_id": r["id"], "method": "POST", "url": "/v1/chat/completions",
                                 "body": body}))
    path.write_text("\n".join(lines) + "\n")
    return len(lines)


def main(argv: list[str]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = make_rows(240, seed=7, domains=list(DOCS))
    pq.write_table(pa.Table.from_pylist(rows), HERE / "documents.parquet", compression="zstd")
    extra = make_rows(60, seed=11, domains=["support"], start=1000)
    import datasets
    out = HERE / "support_extra"
    datasets.Dataset.from_list(extra).save_to_disk(str(out))
    n = write_requests(HERE / "requests.jsonl")
    print(f"wrote {HERE / 'documents.parquet'} ({len(rows)} rows), {out} ({len(extra)} rows) and "
          f"{HERE / 'requests.jsonl'} ({n} requests)")
    if "--check" in argv:
        from transformers import AutoTokenizer

        from engine.loader.resolve import resolve_model
        src = resolve_model("gemma-3-270m")
        tok = AutoTokenizer.from_pretrained(str(src.path.parent), gguf_file=src.path.name)
        doc_lens = [len(tok.encode(r["document"])) for r in rows + extra]
        for d in DOCS:
            print(f"reference {d}: {len(tok.encode(REFERENCES[d]()))} tokens")
        print(f"documents: {min(doc_lens)}-{max(doc_lens)} tokens, mean {sum(doc_lens) / len(doc_lens):.0f}")


if __name__ == "__main__":
    main(sys.argv[1:])
